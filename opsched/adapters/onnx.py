"""ONNX models, and PyTorch modules exported to ONNX, on ONNX Runtime's kernels (``ort``).

* :class:`OnnxAdapter` -- an ONNX model (a ``.onnx`` path, its bytes or a
  ``ModelProto``), its scheduled outputs checked against ONNX Runtime's own
  sequential session (:func:`reference_session`);
* :class:`ExportedTorchAdapter` -- a PyTorch module exported with
  ``torch.onnx.export`` (:func:`import_for_ort`); the export's outputs are
  checked against the module's first (:data:`EXPORT_RTOL`: ONNX Runtime's
  fused kernels sum in another order than PyTorch's), then the scheduled
  run against ONNX Runtime's sequential run;
* :func:`plan_for_ort` -- what the planning model picks on this backend: the
  policy's plan, unless one whole-graph session is predicted at least as fast
  (:func:`opsched.backends.ort_lower.choose_plan`, by :data:`CHOICE_MARGIN`)
  or, for the learned policy, opsched's lane plan
  (:class:`~opsched.policies.ort_lanes.LanePlanner`) beats both.  A measured
  choice then times that plan against ONNX Runtime's one session and keeps the
  faster (the model's error on lowered plans is of the order of the gains
  they promise), so a scheduled model runs no slower than ONNX Runtime alone,
  up to timing noise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from opsched.adapters.base import (
    Adapter,
    Config,
    Fallback,
    FallbackReason,
    Scheduled,
    merged_meta,
    outputs_equal,
)
from opsched.errors import OpschedError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend, PerfModel
    from opsched.policies.base import Policy

#: Tolerance of a scheduled run against ONNX Runtime's sequential run (other thread
#: counts and other session boundaries change float summation order).
ORT_RTOL, ORT_ATOL = 1e-4, 1e-5
#: Tolerance of the exported ONNX model against the eager PyTorch module.
EXPORT_RTOL, EXPORT_ATOL = 1e-3, 1e-4
#: A lowered plan replaces one whole-graph session only when the planning model predicts
#: it this much faster (a fraction): lowered plans pay costs the model prices least well
#: (sessions' cold caches, hand-offs, co-running nodes' interference), and its error on
#: them is of this order (``bench/ort_bench.py``'s sim-to-real section).
CHOICE_MARGIN = 0.25

_CHOICES = IdentityLRU(64)  # per plan: the plan plan_for_ort chose
_GRAPHS = IdentityLRU(8)    # per network and input shapes: its imported graph
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
        try:
            st = Path(model).stat()
        except OSError:
            return None
        return ("file", str(Path(model).resolve()), st.st_size, st.st_mtime_ns, sig, batch)
    if hasattr(model, "state_dict"):
        state = tuple((k, v.data_ptr(), v._version) for k, v in model.state_dict(keep_vars=True).items())
        return ("module", id(model), state, sig)
    return None


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
    """The graph's outputs from ONNX Runtime's own session ``sess``."""
    src = graph.source
    return list(sess.run(list(src.outputs), dict(zip(src.inputs, src.check_inputs(inputs), strict=True))))


def plan_for_ort(graph: OpGraph, plan: Plan, machine: Machine, model: PerfModel, lanes: bool = False) -> Plan:
    """``plan``, or the single-session plan unless the model predicts ``plan`` faster
    by :data:`CHOICE_MARGIN`; with ``lanes`` also opsched's lane plan
    (:class:`~opsched.policies.ort_lanes.LanePlanner`) when the model predicts it
    faster than both (cached per plan)."""
    from opsched.backends.ort_lower import choose_plan
    from opsched.engine.sim import Simulator

    key = (graph.fingerprint(), id(plan), machine.fingerprint(), getattr(model, "name", ""), lanes)
    hit = _CHOICES.get(key, plan)
    if hit is not None:
        return hit
    out = choose_plan(graph, plan, machine, model, margin=CHOICE_MARGIN)
    if lanes:
        from opsched.policies.ort_lanes import LanePlanner

        sim = Simulator(machine, model=model)
        lane = LanePlanner().plan(graph, machine, model)
        t_lane, t_out = sim.makespan(graph, lane), sim.makespan(graph, out)
        if t_lane < t_out * (1.0 - (CHOICE_MARGIN if out.policy == "ort-single" else 0.0)):
            out = merged_meta(lane, instead_of=plan.policy or "plan", predicted_s=t_lane, predicted_instead_s=t_out)
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


class ScheduledOnnx(nn.Module, Scheduled):
    """A model whose calls run a Plan as co-running ONNX Runtime sessions (the ``ort``
    backend, :mod:`opsched.backends.ort_backend`).

    For a PyTorch module (``module``), called like the module with tensors, it
    returns tensors in the module's output structure, and falls back to the
    module itself (eager).  For an ONNX model (``module`` None), called with
    numpy arrays (or tensors), one per graph input, it returns the graph's
    outputs as a list of numpy arrays, and falls back to ONNX Runtime's own
    sequential session (:attr:`reference`)."""

    def __init__(self, module: Any, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Backend | None, fallback: Fallback | None,
                 reference: Any = None, out_spec: Any = None, model_name: str = "model") -> None:
        super().__init__()
        self.module = module
        self.reference = reference
        self.out_spec = out_spec
        self.model_name = model_name
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback)

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Fallback | None:
        """Why this call cannot take the scheduled path, or None."""
        if self.module is not None:
            from opsched.adapters.torch import why_torch_eager

            return why_torch_eager(self, self.module, args, kwargs)
        if self.fallback is not None:
            return self.fallback
        if kwargs:
            return Fallback(FallbackReason.KEYWORDS, f"keyword arguments ({', '.join(kwargs)}) were not part of "
                                                     "the planned call")
        return self._why_inputs(args)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The model without opsched: the module, or ONNX Runtime's sequential session."""
        if self.module is not None:
            return self.module(*args, **kwargs)
        if self.reference is None or self.graph is None:
            raise OpschedError(f"{self.model_name}: ONNX Runtime cannot run this model ({self.fallback_reason})")
        return run_reference(self.reference, self.graph, args)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback:
                self._warn_once(why, self.model_name)
            return self.eager(*args, **kwargs)
        assert self.backend is not None and self.graph is not None and self.plan is not None
        out = self.backend.execute(self.graph, self.plan, args)
        if self.module is None:
            return out
        return unflatten_outputs(out, self.out_spec)

    def time_call(self, *inputs: Any) -> float:
        """Wall seconds of one call (under ``torch.no_grad`` for a PyTorch module)."""
        if self.module is None:
            return super().time_call(*inputs)
        import torch

        with torch.no_grad():
            return super().time_call(*inputs)

    def extra_repr(self) -> str:
        return self._repr(", backend='ort'")


def _session_timer(sess: Any, graph: OpGraph, feeds: Sequence[Any]) -> Callable[[], float]:
    names = list(graph.source.outputs)
    inputs = dict(zip(graph.source.inputs, graph.source.check_inputs(feeds), strict=True))

    def once() -> float:
        t0 = time.perf_counter()
        sess.run(names, inputs)
        return time.perf_counter() - t0

    return once


class OnnxAdapter(Adapter):
    """An ONNX model on ONNX Runtime's kernels, checked against ONNX Runtime's own session."""

    framework = "onnx"
    tolerance = (ORT_RTOL, ORT_ATOL)
    always_time = ("model", "ort-single")

    def __init__(self, network: Any, inputs: Any, backend: str, batch: int = 1) -> None:
        import torch

        if isinstance(inputs, (torch.Tensor, np.ndarray)):
            inputs = (inputs,)
        super().__init__(network, tuple(inputs or ()), backend, batch)
        self._module: Any = None  # the PyTorch module behind it (ExportedTorchAdapter)
        self._spec: Any = None

    @property
    def label(self) -> str:
        model = self.network
        return Path(model).stem if isinstance(model, (str, Path)) else "onnx"

    def import_graph(self) -> OpGraph:
        return import_for_ort(self.network, self.inputs, self.label, self.batch)

    def feeds(self, graph: OpGraph) -> tuple:
        return self.inputs if self.inputs else tuple(graph.source.example_inputs)

    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        return run_reference(reference_session(graph), graph, feeds)

    def choose(self, graph: OpGraph, plan: Plan, found: dict[str, tuple[Plan, float]] | None, machine: Machine,
               model: PerfModel, policy: Policy | None) -> tuple[Plan, dict[str, tuple[Plan, float]] | None]:
        from opsched.backends.ort_lower import single_session_plan
        from opsched.engine.sim import Simulator
        from opsched.policies.exported import ExportedPolicy

        lanes = isinstance(policy, ExportedPolicy) or getattr(policy, "name", "") == "ort-lanes"
        chosen = plan_for_ort(graph, plan, machine, model, lanes=lanes)
        if chosen.policy == "ort-single":
            return chosen, None
        sim = Simulator(machine, model=model)
        single = single_session_plan(graph, machine)
        return chosen, {"model": (chosen, sim.makespan(graph, chosen)),
                        "ort-single": (single, sim.makespan(graph, single))}

    def prepare_backend(self, backend: Backend, model: PerfModel) -> None:
        use = getattr(backend, "use_model", None)
        if callable(use):
            use(model)  # lower plans through the schedule of the model they were made with

    def eager_description(self) -> str:
        return f"{self.label} with ONNX Runtime's sequential session"

    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        ref = reference_session(graph) if graph is not None else None
        return ScheduledOnnx(self._module, feeds, graph=graph, plan=plan, machine=machine, policy=policy,
                             backend=backend, fallback=fallback, reference=ref, out_spec=self._spec,
                             model_name=self.label)

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        return {"ort-sequential": Config(_session_timer(reference_session(graph), graph, feeds),
                                         "ONNX Runtime sequential, default threads")}

    def note(self) -> str | None:
        return ("ort: '= eager' compares with ONNX Runtime's sequential run (and, for a PyTorch model, that run "
                "with eager PyTorch); a plan runs as ONNX Runtime sessions on lanes (opsched.backends.ort_backend)")


class ExportedTorchAdapter(OnnxAdapter):
    """A PyTorch module exported to ONNX and run on ONNX Runtime's kernels."""

    framework = "torch"

    def __init__(self, network: Any, inputs: Any, backend: str, batch: int = 1) -> None:
        super().__init__(network, inputs, backend, batch)
        self._module = network

    @property
    def label(self) -> str:
        return type(self.network).__name__

    def refuse(self) -> Fallback | None:
        if self.network.training:
            return Fallback(FallbackReason.TRAINING_MODE, "the module is in training mode; call module.eval() "
                                                          "before opsched.apply")
        return None

    def feeds(self, graph: OpGraph) -> tuple:
        return self.inputs

    def check_import(self, graph: OpGraph, feeds: tuple) -> Fallback | None:
        import torch

        with torch.no_grad():
            leaves, self._spec = flatten_outputs(self.network(*feeds))
        want = [x.detach().numpy() if isinstance(x, torch.Tensor) else x for x in leaves]
        if not outputs_equal(self.reference(graph, feeds), want, EXPORT_RTOL, EXPORT_ATOL):
            return Fallback(FallbackReason.EXPORT_DIFFERS, "the exported ONNX model's outputs differ from the "
                                                           "module's")
        return None

    def eager_description(self) -> str:
        return self.label

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        import torch

        from opsched.adapters.torch import eager_timer

        out = super().configs(graph, feeds, backend, machine)
        out["eager"] = Config(eager_timer(self.network, feeds), f"torch default ({torch.get_num_threads()} threads)")
        return out


__all__ = ["CHOICE_MARGIN", "EXPORT_ATOL", "EXPORT_RTOL", "ORT_ATOL", "ORT_RTOL", "ExportedTorchAdapter",
           "OnnxAdapter", "ScheduledOnnx", "flatten_outputs", "import_for_ort", "is_onnx_model", "plan_for_ort",
           "reference_session", "remember", "run_reference", "unflatten_outputs"]
