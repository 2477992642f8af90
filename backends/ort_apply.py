"""What ``opsched.apply`` needs to schedule a model on the ``ort`` backend.

* :func:`apply_ort` - ``opsched.apply(..., backend="ort")``;
* :func:`reference_session` - ONNX Runtime's own sequential execution of the
  model at its default threads and optimisation level: the reference a
  scheduled run's outputs are checked against, and the row ``opsched apply``
  times it against;
* :func:`import_for_ort` - the graph ONNX Runtime runs for a PyTorch module
  (exported with ``torch.onnx.export``) or an ONNX model;
* :func:`plan_for_ort` - the plan to run: the policy's, unless the planning
  model says one whole-graph session is at least as fast
  (:func:`opsched.backends.ort_lower.choose_plan`) or, for the learned
  policy, opsched's lane plan (``backends/ort_plans.py``) is faster than both
  (cached, so the same policy plan gives the same Plan object);
* :func:`measured_choice` - the planned plan or ONNX Runtime's one session,
  whichever runs faster when both are timed here (``measure`` >= 2);
* :func:`after_gap` - a timed configuration that first lets spinning intra-op
  threads of the configuration timed before it stop;
* :func:`flatten_outputs` / :func:`unflatten_outputs` - a torch module's output
  structure, which ``torch.onnx.export`` flattens into the graph's outputs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan

#: Tolerance of a scheduled run against ONNX Runtime's sequential run (other thread
#: counts and other session boundaries change float summation order).
ORT_RTOL, ORT_ATOL = 1e-4, 1e-5
#: Tolerance of the exported ONNX model against the eager PyTorch module (ONNX
#: Runtime's fused kernels sum in another order than PyTorch's).
EXPORT_RTOL, EXPORT_ATOL = 1e-3, 1e-4

#: A lowered plan replaces one whole-graph session only when the planning model predicts
#: it this much faster (a fraction): lowered plans pay costs the model prices least well
#: (sessions' cold caches, hand-offs, co-running nodes' interference), and its error on
#: them is of this order (``bench/ort_bench.py``'s sim-to-real section).
CHOICE_MARGIN = 0.25

#: Per plan: the plan :func:`plan_for_ort` chose, and the one :func:`measured_choice` kept.
_CHOICES, _MEASURED = IdentityLRU(64), IdentityLRU(64)
_LOCK = threading.Lock()


def is_onnx_model(model: Any) -> bool:
    """An ONNX model given to ``opsched.apply``: a ``.onnx`` path, serialised bytes or a ModelProto."""
    if isinstance(model, (str, Path)):
        return str(model).endswith(".onnx")
    return isinstance(model, bytes) or (hasattr(model, "graph") and hasattr(model, "SerializeToString"))


def _graph_key(model: Any, inputs: Sequence[Any], batch: int) -> tuple | None:
    """What identifies an import: the model (a torch module by identity and the
    storage and version of every parameter and buffer, so an in-place weight
    update re-exports; an ONNX file by path, size and time) and the inputs' shapes."""
    sig = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in inputs)
    if isinstance(model, (str, Path)):
        st = Path(model).stat()
        return ("file", str(Path(model).resolve()), st.st_size, st.st_mtime_ns, sig, batch)
    if hasattr(model, "state_dict"):
        state = tuple((k, v.data_ptr(), v._version) for k, v in model.state_dict(keep_vars=True).items())
        return ("module", id(model), state, sig)
    return None


_GRAPHS = IdentityLRU(8)


def remember(model: Any, inputs: Sequence[Any], graph: OpGraph, batch: int = 1) -> None:
    """Let :func:`import_for_ort` reuse ``graph`` for ``model`` on inputs of these shapes."""
    key = _graph_key(model, inputs, batch)
    if key is not None:
        _GRAPHS.put(key, graph, model)


def import_for_ort(model: Any, inputs: Sequence[Any], name: str, batch: int = 1) -> OpGraph:
    """The ORT graph of a torch module (exported) or an ONNX model (``inputs`` may be
    empty); the last few imports are kept (:func:`remember`), so scheduling one model
    with several policies exports and optimises it once."""
    from opsched.importers.onnx_graph import from_onnx, from_torch_via_onnx

    key = _graph_key(model, inputs, batch)
    hit = _GRAPHS.get(key, model) if key is not None else None
    if hit is not None:
        return hit
    if is_onnx_model(model):
        graph = from_onnx(model, inputs or None, name=name, batch=batch)
    else:
        graph = from_torch_via_onnx(model, inputs, name=name, key=None)
    remember(model, inputs, graph, batch)
    return graph


def reference_session(graph: OpGraph, threads: int = 0) -> Any:
    """ONNX Runtime's sequential execution of the graph's model (before opsched
    touched it) at ``threads`` intra-op threads (0: its default) and the
    optimisation level the graph was imported at (one per graph source and
    thread count: building it optimises the whole model again)."""
    import onnxruntime as ort

    from opsched.importers.onnx_graph import session_options

    src = graph.source
    cache = src.__dict__.setdefault("_reference_sessions", {})
    with _LOCK:
        hit = cache.get(threads)
    if hit is None:
        hit = ort.InferenceSession(src.original, session_options(threads, src.opt_level),
                                   providers=["CPUExecutionProvider"])
        with _LOCK:
            cache[threads] = hit
    return hit


def run_reference(sess: Any, graph: OpGraph, inputs: Sequence[Any]) -> list[np.ndarray]:
    src = graph.source
    return list(sess.run(list(src.outputs), dict(zip(src.inputs, src.check_inputs(inputs), strict=True))))


def plan_for_ort(graph: OpGraph, plan: Plan, machine: Machine, model: PerfModel, lanes: bool = False) -> Plan:
    """``plan``, or the single-session plan unless the model predicts ``plan`` faster
    by :data:`CHOICE_MARGIN`;
    with ``lanes`` also opsched's lane plan (:class:`~opsched.backends.ort_plans.LanePlanner`)
    when the model predicts it faster than both (cached per plan)."""
    from opsched.backends.ort_lower import choose_plan

    key = (graph.fingerprint(), id(plan), machine.fingerprint(), getattr(model, "name", ""), lanes)
    hit = _CHOICES.get(key, plan)
    if hit is not None:
        return hit
    out = choose_plan(graph, plan, machine, model, margin=CHOICE_MARGIN)
    if lanes:
        from opsched.backends.ort_plans import LanePlanner
        from opsched.backends.sim import SimBackend

        sim = SimBackend(machine, model=model)
        lane = LanePlanner().plan(graph, machine, model)
        t_lane, t_out = sim.run(graph, lane).makespan, sim.run(graph, out).makespan
        if t_lane < t_out * (1.0 - (CHOICE_MARGIN if out.policy == "ort-single" else 0.0)):
            out = Plan(lane.assignments, lane.graph_fingerprint, lane.machine_fingerprint, lane.policy,
                       {**dict(lane.meta), "instead_of": plan.policy or "plan", "predicted_s": t_lane,
                        "predicted_instead_s": t_out})
    _CHOICES.put(key, out, plan)
    return out


def flatten_outputs(out: Any) -> tuple[list[Any], Any]:
    """A torch module's output as a flat list of leaves and the structure to rebuild it."""
    from torch.utils import _pytree

    leaves, spec = _pytree.tree_flatten(out)
    return leaves, spec


def unflatten_outputs(arrays: Sequence[np.ndarray], spec: Any) -> Any:
    """The module's output structure from the graph's outputs (as tensors)."""
    import torch
    from torch.utils import _pytree

    return _pytree.tree_unflatten([torch.from_numpy(np.asarray(a)) for a in arrays], spec)


def after_gap(fn: Callable[[], float], gap_s: float | None = None) -> Callable[[], float]:
    """A timed configuration that first pauses (untimed) for ``gap_s`` (default
    :data:`~opsched.backends.ort_fit.SPIN_GAP_S`): the configuration timed before
    it may have left ONNX Runtime's intra-op threads spinning on a core."""
    from opsched.backends.ort_fit import SPIN_GAP_S

    pause = SPIN_GAP_S if gap_s is None else gap_s

    def timed() -> float:
        time.sleep(pause)
        return fn()

    return timed



def measured_choice(be: Any, graph: OpGraph, chosen: Plan, machine: Machine, model: PerfModel,
                    inputs: Sequence[Any], measure: int) -> Plan:
    """``chosen``, or ONNX Runtime's one session when that runs faster here.

    The planning model's error on lowered plans is of the order of the gains
    they promise (sim-to-real 22% on this backend), and with no profile it is
    the analytic model, which knows nothing of ONNX Runtime's fused kernels;
    so when the model picked a lowered plan, it and the single-session plan are
    both timed on the example inputs (:func:`opsched.measured.choose_measured`,
    each call after :func:`after_gap`) and the faster median is kept: a plan
    then runs no slower than ONNX Runtime alone, up to timing noise.  The
    choice is kept per plan (like the plans themselves), so scheduling the same
    model again neither re-times nor changes it."""
    from opsched.backends.ort_lower import single_session_plan
    from opsched.backends.sim import SimBackend
    from opsched.measured import choose_measured

    if measure < 2 or chosen.policy == "ort-single":
        return chosen
    key = (graph.fingerprint(), id(chosen), machine.fingerprint(), measure)
    hit = _MEASURED.get(key, chosen)
    if hit is not None:
        return hit
    sim = SimBackend(machine, model=model)
    single = single_session_plan(graph, machine)
    candidates = {"model": (chosen, sim.run(graph, chosen).makespan),
                  "ort-single": (single, sim.run(graph, single).makespan)}
    out = choose_measured(be, graph, candidates, inputs, top=2, always=("model", "ort-single"), wrap=after_gap)
    _MEASURED.put(key, out, chosen)
    return out


def apply_ort(policy: Any, model: Any, example_inputs: Any, machine: Machine, perf_model: PerfModel | str,
              plan: Plan | None, verify: bool, runtime: Any, batch: int, auto: bool, measure: int = 0) -> Any:
    """:func:`opsched.apply` on the ``ort`` backend: a :class:`~opsched.scheduled.ScheduledOnnx`
    (never raises for a model it cannot schedule: the result then runs eagerly, a
    ScheduleFallbackWarning says why).  None when ``auto`` chose ``ort`` for a
    PyTorch module that does not export (the caller schedules it on torch-cpu)."""
    import warnings

    import torch

    from opsched.errors import OpschedError, PolicyError
    from opsched.planning import planning_model
    from opsched.policies.exported import ExportedPolicy
    from opsched.scheduled import (
        ScheduledOnnx,
        ScheduleFallbackWarning,
        _plan,
        _resolve,
        outputs_equal,
        shared_backend,
    )

    module = None if is_onnx_model(model) else model
    label = type(model).__name__ if module is not None else (
        Path(model).stem if isinstance(model, (str, Path)) else "onnx")
    if isinstance(example_inputs, (torch.Tensor, np.ndarray)):
        inputs: tuple = (example_inputs,)
    else:
        inputs = tuple(example_inputs or ())
    pol: Any = None
    graph: Any = None
    ref: Any = None
    spec: Any = None

    def fallback(reason: str, g: OpGraph | None = None, p: Plan | None = None) -> Any:
        what = label if module is not None else f"{label} with ONNX Runtime's sequential session"
        warnings.warn(f"opsched.apply: {reason}; running {what} eagerly", ScheduleFallbackWarning, stacklevel=4)
        return ScheduledOnnx(module, inputs, graph=g, plan=p, machine=machine, policy=pol, backend=None,
                             fallback_reason=reason, reference=ref, out_spec=spec, model_name=label)

    try:
        pol = _resolve(policy, plan)
    except PolicyError as exc:
        return fallback(f"cannot use the policy: {exc}")
    if module is not None and module.training:
        return fallback("the module is in training mode; call module.eval() before opsched.apply")
    try:
        graph = import_for_ort(model, inputs, label, batch)
    except OpschedError as exc:
        if plan is not None and not auto:
            raise
        if auto and module is not None:
            return None
        return fallback(f"cannot import the model into ONNX Runtime: {exc}")
    if not inputs:
        inputs = tuple(graph.source.example_inputs)
    ref = reference_session(graph)
    if module is not None:
        with torch.no_grad():
            leaves, spec = flatten_outputs(module(*inputs))
        exported = run_reference(ref, graph, inputs)
        want = [x.detach().numpy() if isinstance(x, torch.Tensor) else x for x in leaves]
        if not outputs_equal(exported, want, EXPORT_RTOL, EXPORT_ATOL):
            if auto:
                return None
            return fallback("the exported ONNX model's outputs differ from the module's", graph)
    if plan is not None:
        plan.validate(graph, machine)
    try:
        t0 = time.perf_counter()
        chosen, plan_s = _plan(pol, plan, graph, machine, "ort", perf_model)
        if plan is None:
            model_ = planning_model(machine, "ort", perf_model) if isinstance(perf_model, str) else perf_model
            chosen = plan_for_ort(graph, chosen, machine, model_,
                                  lanes=isinstance(pol, ExportedPolicy) or getattr(pol, "name", "") == "ort-lanes")
            plan_s = time.perf_counter() - t0
    except (OpschedError, ValueError) as exc:
        return fallback(f"the policy cannot plan this graph: {exc}", graph)
    be = runtime if runtime is not None else shared_backend("ort", machine)
    if plan is None and hasattr(be, "use_model"):
        be.use_model(model_)  # lower plans through the schedule of the model they were made with
    if verify:
        try:
            same = outputs_equal(be.execute(graph, chosen, inputs), run_reference(ref, graph, inputs),
                                 ORT_RTOL, ORT_ATOL)
        except OpschedError as exc:
            return fallback(f"the scheduled run failed: {exc}", graph, chosen)
        if not same:
            return fallback("the scheduled run's outputs differ from ONNX Runtime's sequential run", graph, chosen)
    if plan is None:
        t1 = time.perf_counter()
        try:
            chosen = measured_choice(be, graph, chosen, machine, model_, inputs, measure)
        except OpschedError as exc:
            return fallback(f"the scheduled run failed: {exc}", graph, chosen)
        plan_s += time.perf_counter() - t1  # timing the candidates is part of choosing the plan
    out = ScheduledOnnx(module, inputs, graph=graph, plan=chosen, machine=machine, policy=pol, backend=be,
                        fallback_reason=None, reference=ref, out_spec=spec, model_name=label)
    out.plan_s = plan_s
    return out


__all__ = ["CHOICE_MARGIN", "EXPORT_ATOL", "EXPORT_RTOL", "ORT_ATOL", "ORT_RTOL", "after_gap", "apply_ort",
           "flatten_outputs", "import_for_ort", "is_onnx_model", "measured_choice", "plan_for_ort", "reference_session", "remember",
           "run_reference", "unflatten_outputs"]
