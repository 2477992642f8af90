"""``opsched.apply(policy, model, example_inputs)``: a model that runs under a schedule.

The model is imported into an OpGraph, the policy plans it for this machine
with the planning model (:func:`opsched.planning.planning_model`: the fitted
performance model plus the runtime's model when ``opsched profile`` made
them, else the analytic one), and the returned object runs that Plan on a
real runtime: a :class:`ScheduledModule` (an ``nn.Module``) on the PyTorch
CPU runtime for a torch module, a :class:`ScheduledKeras` on the TensorFlow
runtime for a Keras model, a :class:`ScheduledOnnx` on ONNX Runtime's kernels
(the ``ort`` backend: co-running sessions) for an ONNX model or a torch module
exported to ONNX.

Correctness comes first.  The scheduled path is checked once against eager
execution on the example inputs (:func:`outputs_equal`, the one output check
of opsched), and every call checks that its inputs have the shapes and dtypes
the Plan was made for.  Whenever the policy cannot plan, the model cannot be
imported, the check fails or a call's inputs differ, the result says so with
a :class:`ScheduleFallbackWarning` and runs eagerly: slower, never wrong.

The scheduled path is inference only: it runs under ``torch.no_grad`` and its
outputs carry no autograd graph (a call whose inputs require grad, or a module
in training mode, runs eagerly).  ``policy=None`` means the policy shipped
with opsched (``opsched.policies.exported.pretrained_path()``).
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opsched.engine.contracts import PerfModel
from opsched.errors import OpschedError, PolicyError
from opsched.graph import OpGraph
from opsched.machine import Machine, get_machine
from opsched.measured import DEFAULT_TOP
from opsched.plan import Plan
from opsched.planning import candidates_cached, plan_cached, planning_model, resolve_policy
from opsched.policies.base import Policy

#: Output tolerance of the check against eager for PyTorch (thread counts change
#: float summation order; the runtime's own tests use the same bounds).
RTOL, ATOL = 1e-4, 1e-5
#: TensorFlow's graph runtime (Grappler's remapper fuses ops, oneDNN picks other
#: kernels) sums in another order than eager Keras: float32 round-off, not errors.
TF_RTOL, TF_ATOL = 1e-3, 1e-5
#: ``backend=`` choices of :func:`apply`.
BACKENDS = ("auto", "torch-cpu", "tf", "ort")
#: What ``backend="auto"`` runs a PyTorch module on: ``ort`` - ONNX Runtime's kernels
#: (fused, blocked layouts) run the zoo faster than PyTorch's (the benchmark report's ORT
#: column), and on ``ort`` a plan the model does not predict faster than ONNX Runtime's own
#: sequential run is replaced by it - when onnx and onnxruntime import and the module
#: exports to ONNX with outputs that match the module's, else ``torch-cpu``.
#: ``backend="torch-cpu"`` keeps PyTorch's kernels.  See :func:`resolve_backend`.
AUTO_TORCH = "ort"

_BACKENDS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


class ScheduleFallbackWarning(UserWarning):
    """The scheduled path is not used (the message says why); the model runs eagerly."""


# ------------------------------------------------------------------ checks
def outputs_equal(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """Same structure, and every tensor or array of the same shape and dtype and allclose."""
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
                and got.dtype == want.dtype and bool(torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)))
    if isinstance(got, np.ndarray) or isinstance(want, np.ndarray):
        got, want = np.asarray(got), np.asarray(want)
        return got.shape == want.shape and got.dtype == want.dtype and bool(
            np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(outputs_equal(x, y, rtol, atol) for x, y in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(outputs_equal(got[k], want[k], rtol, atol) for k in got)
    return got == want


def _signature(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype).removeprefix("torch."), x.device.type)
    if isinstance(x, np.ndarray):
        return ("array", tuple(x.shape), str(x.dtype), "cpu")
    return ("value", type(x).__name__, repr(x))


def _describe(sig: tuple) -> str:
    return "(" + ", ".join(f"{s[2]}{list(s[1])}@{s[3]}" if s[0] != "value" else f"{s[1]} {s[2]}"
                           for s in sig) + ")"


# ---------------------------------------------------------------- backends
def shared_backend(name: str, machine: Machine) -> Any:
    """One backend per (runtime, machine) for every scheduled model of the process
    (one worker pool, not one per model; closed at exit)."""
    key = (name, machine.fingerprint())
    with _LOCK:
        be = _BACKENDS.get(key)
        if be is None:
            from opsched.backends.registry import get_backend

            be = _BACKENDS[key] = get_backend(name, machine)
            atexit.register(be.close)
        return be


def _auto_torch() -> str:
    """``AUTO_TORCH``, or ``torch-cpu`` when it is ``ort`` but onnx / onnxruntime do not import."""
    if AUTO_TORCH != "ort":
        return AUTO_TORCH
    import importlib.util

    ok = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))
    return "ort" if ok else "torch-cpu"


def resolve_backend(choice: str, framework: str, what: str = "the model") -> str:
    """The runtime ``backend=choice`` means for a model of ``framework`` ("torch", "keras" or "onnx")."""
    if choice not in BACKENDS:
        raise OpschedError(f"unknown backend {choice!r}; choose from {', '.join(BACKENDS)}")
    if framework == "onnx":
        if choice in ("auto", "ort"):
            return "ort"
        raise OpschedError(f"backend {choice} cannot run {what}, an ONNX model; use ort (or auto)")
    if choice == "ort" and framework != "torch":
        raise OpschedError(f"backend ort runs ONNX and PyTorch models, but {what} is a Keras model; use tf "
                           "(or auto)")
    if choice == "auto":
        return "tf" if framework == "keras" else _auto_torch()
    if choice == "tf" and framework != "keras":
        raise OpschedError(f"backend tf runs Keras models, but {what} is a PyTorch model; use torch-cpu (or auto)")
    if choice == "torch-cpu" and framework != "torch":
        raise OpschedError(f"backend torch-cpu runs PyTorch modules, but {what} is a Keras model; use tf (or auto)")
    return choice


# ----------------------------------------------------------- scheduled models
class _Scheduled:
    """What every scheduled model holds: its graph, plan, machine, policy, backend,
    and why it runs eagerly (``fallback_reason``; None while scheduled)."""

    graph: OpGraph | None
    plan: Plan | None
    #: Seconds the policy took to plan (None: a saved plan, or no plan).
    plan_s: float | None = None
    machine: Machine
    policy: Policy | None
    backend: Any
    fallback_reason: str | None
    _signature: tuple
    _warned: set[str]

    def _hold(self, example_inputs: tuple, graph: OpGraph | None, plan: Plan | None, machine: Machine,
              policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        self.graph, self.plan, self.machine, self.policy = graph, plan, machine, policy
        self.backend = backend
        self.fallback_reason = fallback_reason
        self.example_inputs = example_inputs
        self._signature = tuple(_signature(x) for x in example_inputs)
        self._warned = set()

    @property
    def scheduled(self) -> bool:
        """True while calls with the planned inputs run the Plan."""
        return self.fallback_reason is None

    def _warn_once(self, reason: str, what: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"opsched.apply: {reason}; running {what} eagerly", ScheduleFallbackWarning, stacklevel=4)

    def _why_inputs(self, args: Sequence[Any]) -> str | None:
        sig = tuple(_signature(x) for x in args)
        if sig != self._signature:
            return (f"the inputs {_describe(sig)} differ from the planned {_describe(self._signature)} "
                    "(apply again with example inputs of the new shape)")
        return None

    def _why_torch_eager(self, module: nn.Module | None, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """Why a call of a PyTorch-facing scheduled model cannot run the Plan, or None."""
        if self.fallback_reason is not None:
            return self.fallback_reason
        if kwargs:
            return f"keyword arguments ({', '.join(kwargs)}) were not part of the planned call"
        if module is not None and module.training:
            return "the module is in training mode (the Plan was made for eval mode)"
        why = self._why_inputs(args)
        if why is None and torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                           for x in args):
            why = "an input requires grad (the scheduled path is inference only)"
        return why

    def time_call(self, *inputs: Any) -> float:
        """Wall seconds of one inference (under ``torch.no_grad``)."""
        with torch.no_grad():
            t0 = time.perf_counter()
            self(*inputs)
            return time.perf_counter() - t0

    def _repr(self, what: str = "") -> str:
        if self.plan is None:
            return f"eager (fallback: {self.fallback_reason})"
        return (f"policy={self.plan.policy!r}{what}, machine={self.machine.name!r}, ops={len(self.graph.ops)}"
                + ("" if self.scheduled else f", eager (fallback: {self.fallback_reason})"))


class ScheduledModule(nn.Module, _Scheduled):
    """``module`` whose ``forward`` runs a Plan on the PyTorch CPU runtime."""

    def __init__(self, module: nn.Module, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        super().__init__()
        self.module = module
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback_reason)

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """Why this call cannot take the scheduled path, or None."""
        return self._why_torch_eager(self.module, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback_reason:
                self._warn_once(why, type(self.module).__name__)
            return self.module(*args, **kwargs)
        return self.backend.execute(self.graph, self.plan, args)

    def extra_repr(self) -> str:
        return self._repr()


class ScheduledKeras(_Scheduled):
    """A Keras model whose calls run a Plan on the TensorFlow runtime
    (:mod:`opsched.backends.tf_cpu`); called with numpy arrays (one per model
    input), it returns the model's outputs as a list of numpy arrays (flattened
    as ``tf.nest.flatten`` orders them)."""

    def __init__(self, model: Any, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        self.model = model
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback_reason)

    def eager(self, *feeds: np.ndarray) -> list[np.ndarray]:
        """The Keras model called eagerly (``training=False``), outputs flattened."""
        return keras_eager(self.model, feeds)

    def __call__(self, *feeds: np.ndarray) -> list[np.ndarray]:
        why = self.fallback_reason or self._why_inputs(feeds)
        if why is not None:
            if why is not self.fallback_reason:
                self._warn_once(why, type(self.model).__name__)
            return self.eager(*feeds)
        return self.backend.execute(self.graph, self.plan, list(feeds))

    def time_call(self, *feeds: np.ndarray) -> float:
        """Seconds of one inference, timed inside the TensorFlow worker around the
        session call (no inter-process transfer counted), or eagerly on fallback."""
        if self.fallback_reason is not None or self._why_inputs(feeds) is not None:
            t0 = time.perf_counter()
            self(*feeds)
            return time.perf_counter() - t0
        return self.backend.time_plan(self.graph, self.plan, repeats=1, warmup=0, inputs=list(feeds))[0]


class ScheduledOnnx(nn.Module, _Scheduled):
    """A model whose calls run a Plan as co-running ONNX Runtime sessions (the ``ort``
    backend, :mod:`opsched.backends.ort_backend`).

    For a PyTorch module (``module``), called like the module with tensors, it
    returns tensors in the module's output structure, and falls back to the
    module itself (eager).  For an ONNX model (``module`` None), called with
    numpy arrays (or tensors), one per graph input, it returns the graph's
    outputs as a list of numpy arrays, and falls back to ONNX Runtime's own
    sequential session (:attr:`reference`)."""

    def __init__(self, module: nn.Module | None, example_inputs: tuple, *, graph: OpGraph | None,
                 plan: Plan | None, machine: Machine, policy: Policy | None, backend: Any,
                 fallback_reason: str | None, reference: Any = None, out_spec: Any = None,
                 model_name: str = "model") -> None:
        super().__init__()
        self.module = module
        self.reference = reference
        self.out_spec = out_spec
        self.model_name = model_name
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback_reason)

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """Why this call cannot take the scheduled path, or None."""
        return self._why_torch_eager(self.module, args, kwargs)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The model without opsched: the module, or ONNX Runtime's sequential session."""
        if self.module is not None:
            return self.module(*args, **kwargs)
        if self.reference is None:
            raise OpschedError(f"{self.model_name}: ONNX Runtime cannot run this model ({self.fallback_reason})")
        from opsched.backends.ort_apply import run_reference

        return run_reference(self.reference, self.graph, args)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback_reason:
                self._warn_once(why, self.model_name)
            return self.eager(*args, **kwargs)
        out = self.backend.execute(self.graph, self.plan, args)
        if self.module is None:
            return out
        from opsched.backends.ort_apply import unflatten_outputs

        return unflatten_outputs(out, self.out_spec)

    def extra_repr(self) -> str:
        return self._repr(", backend='ort'")


def keras_eager(model: Any, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
    """A Keras model called eagerly, its outputs flattened as the importer fetches them."""
    import tensorflow as tf

    out = model(feeds[0] if len(feeds) == 1 else list(feeds), training=False)
    return [np.asarray(t) for t in tf.nest.flatten(out)]


def _is_keras(model: Any) -> bool:
    from opsched.specs import _is_keras as is_keras

    return is_keras(model)


# -------------------------------------------------------------------- apply
def apply(policy: Policy | str | Path | None, model: Any, example_inputs: Any = None, *, backend: str = "auto",
          machine: Machine | str | None = None, perf_model: PerfModel | str = "auto", plan: Plan | None = None,
          verify: bool = True, runtime: Any = None, batch: int = 1,
          measure: int = DEFAULT_TOP) -> ScheduledModule | ScheduledKeras | ScheduledOnnx:
    """Plan ``model`` with ``policy`` and return it scheduled (see the module docstring).

    ``policy``: an exported policy's folder, a Policy, a heuristic's name, or
    None for the shipped policy.  ``model``: an ``nn.Module`` (in eval mode),
    a built Keras model, or an ONNX model (a ``.onnx`` path, its bytes or a
    ``ModelProto``).  ``example_inputs``: a tensor or a tuple of them
    (numpy arrays for Keras and ONNX; default: the importer's random inputs), with the
    shapes later calls will use.  ``backend``: ``auto`` (the model's
    framework's runtime: :data:`AUTO_TORCH` for a PyTorch module, ``ort`` for
    an ONNX model), ``torch-cpu``, ``tf`` or ``ort`` (ONNX Runtime's kernels;
    a PyTorch module is exported to ONNX first, and its outputs are checked
    against ONNX Runtime's sequential run).  ``machine``: this machine
    by default (probed; the runtime executes here).  ``perf_model``: ``auto``,
    ``analytic``, ``fitted`` or a performance model object.  ``plan``: run
    this saved Plan instead of planning.  ``verify``: run the Plan once on the
    example inputs and compare with eager execution.  ``runtime``: an open
    backend to run on (default: one shared per process).  ``batch``: the batch
    size a Keras model is planned for when no example inputs are given.
    ``measure``: how many of a learned policy's best candidate plans (by the
    planning model) are timed on the runtime, on the example inputs, the
    fastest kept (:mod:`opsched.measured`; ``plan.meta["measured"]``); 0 or 1
    trusts the model alone.  On ``ort`` the choice is ONNX Runtime's one
    session unless the model predicts a plan clearly faster
    (:mod:`opsched.backends.ort_apply`) and, with ``measure`` >= 2, that plan
    also runs faster than the one session when both are timed here.

    Never raises for a model it cannot schedule: the result then runs eagerly
    and a :class:`ScheduleFallbackWarning` says why (errors in the arguments
    themselves -- not a model, an unknown machine or backend, a saved ``plan``
    made for another graph or machine -- still raise)."""
    from opsched.backends.ort_apply import is_onnx_model

    keras = _is_keras(model)
    onnx = not keras and is_onnx_model(model)
    if not keras and not onnx and not isinstance(model, nn.Module):
        raise TypeError(f"opsched.apply: expected a torch.nn.Module, a Keras model or an ONNX model, got "
                        f"{type(model).__name__}")
    framework = "keras" if keras else "onnx" if onnx else "torch"
    name = resolve_backend(backend, framework, type(model).__name__)
    machine = (runtime.machine if runtime is not None else get_machine(machine or "local")).cpu_only()
    if name == "ort":
        from opsched.backends.ort_apply import apply_ort

        out = apply_ort(policy, model, example_inputs, machine, perf_model, plan, verify, runtime, batch,
                        auto=backend == "auto", measure=measure)
        if out is not None:
            return out
        name = "torch-cpu"  # auto: the export did not work; the PyTorch runtime schedules the module
    if keras:
        from opsched.importers.tf_graph import from_keras

        given = None if example_inputs is None else (
            tuple(np.asarray(a) for a in example_inputs) if isinstance(example_inputs, (list, tuple))
            else (np.asarray(example_inputs),))
        size = int(given[0].shape[0]) if given else batch
        return _schedule(
            ScheduledKeras, model, given or (), policy, plan, name, machine, perf_model, verify, runtime, measure,
            import_graph=lambda: from_keras(model, batch=size, name=type(model).__name__),
            feeds_of=lambda graph: given if given is not None else tuple(graph.source.random_inputs(0)),
            eager=lambda feeds: keras_eager(model, feeds), tolerance=(TF_RTOL, TF_ATOL))
    from opsched.importers.torch_fx import from_torch

    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    return _schedule(
        ScheduledModule, model, inputs, policy, plan, name, machine, perf_model, verify, runtime, measure,
        import_graph=lambda: from_torch(model, inputs, name=type(model).__name__),
        feeds_of=lambda graph: inputs, eager=lambda feeds: model(*feeds), tolerance=(RTOL, ATOL),
        refuse="the module is in training mode; call module.eval() before opsched.apply" if model.training else None)


def _schedule(cls: Any, model: Any, inputs: tuple, policy: Any, plan: Plan | None, backend: str, machine: Machine,
              perf_model: PerfModel | str, verify: bool, runtime: Any, measure: int, *,
              import_graph: Callable[[], OpGraph], feeds_of: Callable[[OpGraph], tuple],
              eager: Callable[[tuple], Any], tolerance: tuple[float, float], refuse: str | None = None) -> Any:
    """What :func:`apply` does for a PyTorch module or a Keras model (``cls`` wraps
    it): resolve the policy, import the graph, plan, time the candidates, check
    the outputs once against ``eager``; any step that fails returns the model
    running eagerly, with a :class:`ScheduleFallbackWarning` saying why."""
    pol: Policy | None = None
    feeds = inputs

    def fallback(reason: str, graph: OpGraph | None = None, plan: Plan | None = None) -> Any:
        warnings.warn(f"opsched.apply: {reason}; running {type(model).__name__} eagerly",
                      ScheduleFallbackWarning, stacklevel=4)
        return cls(model, feeds, graph=graph, plan=plan, machine=machine, policy=pol, backend=None,
                   fallback_reason=reason)

    try:
        pol = _resolve(policy, plan)
    except PolicyError as exc:
        return fallback(f"cannot use the policy: {exc}")
    if refuse is not None:
        return fallback(refuse)
    try:
        graph = import_graph()
    except OpschedError as exc:
        if plan is not None:
            raise
        return fallback(f"cannot import the model: {exc}")
    feeds = feeds_of(graph)
    if plan is not None:
        plan.validate(graph, machine)  # a saved plan for another graph or machine is an argument error
    try:
        plan, plan_s, found = _plan_candidates(pol, plan, graph, machine, backend, perf_model)
    except (OpschedError, ValueError) as exc:
        return fallback(f"the policy cannot plan this graph: {exc}", graph)
    be = runtime if runtime is not None else shared_backend(backend, machine)
    try:
        plan = _measured(plan, found, graph, be, feeds, measure)
        if verify:
            with torch.no_grad():
                same = outputs_equal(be.execute(graph, plan, feeds), eager(feeds), *tolerance)
            if not same:
                return fallback("the scheduled run's outputs differ from eager execution", graph, plan)
    except OpschedError as exc:
        return fallback(f"the scheduled run failed: {exc}", graph, plan)
    out = cls(model, feeds, graph=graph, plan=plan, machine=machine, policy=pol, backend=be, fallback_reason=None)
    out.plan_s = plan_s
    return out


def _plan(pol: Policy | None, plan: Plan | None, graph: OpGraph, machine: Machine, backend: str,
          perf_model: PerfModel | str) -> tuple[Plan, float | None]:
    """The policy's Plan and the seconds planning took; a given saved Plan is
    validated (a plan for another graph or machine raises :class:`PlanError`:
    an argument error, not a reason to fall back)."""
    out, seconds, _ = _plan_candidates(pol, plan, graph, machine, backend, perf_model)
    return out, seconds


def _plan_candidates(pol: Policy | None, plan: Plan | None, graph: OpGraph, machine: Machine, backend: str,
                     perf_model: PerfModel | str) -> tuple[Plan, float | None, dict[str, tuple[Plan, float]] | None]:
    """:func:`_plan`, plus every candidate plan the policy chose among (None for a
    heuristic or a saved Plan): what :func:`_measured` times."""
    if plan is not None:
        plan.validate(graph, machine)
        return plan, None, None
    model = planning_model(machine, backend, perf_model) if isinstance(perf_model, str) else perf_model
    t0 = time.perf_counter()
    found = candidates_cached(pol, graph, machine, model)
    out = plan_cached(pol, graph, machine, model)
    seconds = time.perf_counter() - t0
    out.validate(graph, machine)
    return out, seconds, found


def _measured(plan: Plan, found: dict[str, tuple[Plan, float]] | None, graph: OpGraph, be: Any,
              inputs: Sequence[Any], measure: int) -> Plan:
    """``plan``, or the fastest of the ``measure`` best candidates timed on ``be``
    (:func:`opsched.measured.choose_measured`)."""
    if found is None or measure < 2:
        return plan
    from opsched.measured import choose_measured

    return choose_measured(be, graph, found, inputs, top=measure)


def _resolve(policy: Any, plan: Plan | None) -> Policy | None:
    return None if plan is not None else resolve_policy(policy)


__all__ = ["BACKENDS", "ScheduleFallbackWarning", "ScheduledKeras", "ScheduledModule", "ScheduledOnnx", "apply",
           "keras_eager", "outputs_equal", "resolve_backend", "shared_backend"]
