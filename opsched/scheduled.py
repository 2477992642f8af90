"""``opsched.apply(policy, model, example_inputs)``: a model that runs under a schedule.

The model is imported into an OpGraph, the policy plans it for this machine
with the planning model (:func:`opsched.planning.planning_model`: the fitted
performance model plus the runtime's model when ``opsched profile`` made
them, else the analytic one), and the returned object runs that Plan on a
real runtime: a :class:`ScheduledModule` (an ``nn.Module``) on the PyTorch
CPU runtime for a torch module, a :class:`ScheduledKeras` on the TensorFlow
runtime for a Keras model.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opsched.engine.contracts import PerfModel
from opsched.errors import OpschedError, PolicyError
from opsched.graph import OpGraph
from opsched.machine import Machine, get_machine
from opsched.plan import Plan
from opsched.planning import plan_cached, planning_model, resolve_policy
from opsched.policies.base import Policy

#: Output tolerance of the check against eager for PyTorch (thread counts change
#: float summation order; the runtime's own tests use the same bounds).
RTOL, ATOL = 1e-4, 1e-5
#: TensorFlow's graph runtime (Grappler's remapper fuses ops, oneDNN picks other
#: kernels) sums in another order than eager Keras: float32 round-off, not errors.
TF_RTOL, TF_ATOL = 1e-3, 1e-5
#: ``backend=`` choices of :func:`apply`.
BACKENDS = ("auto", "torch-cpu", "tf")

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


def resolve_backend(choice: str, framework: str, what: str = "the model") -> str:
    """The runtime ``backend=choice`` means for a model of ``framework`` ("torch" or "keras")."""
    if choice not in BACKENDS:
        raise OpschedError(f"unknown backend {choice!r}; choose from {', '.join(BACKENDS)}")
    if choice == "auto":
        return "tf" if framework == "keras" else "torch-cpu"
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


class ScheduledModule(nn.Module, _Scheduled):
    """``module`` whose ``forward`` runs a Plan on the PyTorch CPU runtime."""

    def __init__(self, module: nn.Module, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        super().__init__()
        self.module = module
        self.graph, self.plan, self.machine, self.policy = graph, plan, machine, policy
        self.backend = backend
        self.fallback_reason = fallback_reason
        self._signature = tuple(_signature(x) for x in example_inputs)
        self._warned = set()

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """Why this call cannot take the scheduled path, or None."""
        if self.fallback_reason is not None:
            return self.fallback_reason
        if kwargs:
            return f"keyword arguments ({', '.join(kwargs)}) were not part of the planned call"
        if self.module.training:
            return "the module is in training mode (the Plan was made for eval mode)"
        why = self._why_inputs(args)
        if why is None and torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                           for x in args):
            why = "an input requires grad (the scheduled path is inference only)"
        return why

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback_reason:
                self._warn_once(why, type(self.module).__name__)
            return self.module(*args, **kwargs)
        return self.backend.execute(self.graph, self.plan, args)

    def time_call(self, *inputs: Any) -> float:
        """Wall seconds of one inference (under ``torch.no_grad``)."""
        with torch.no_grad():
            t0 = time.perf_counter()
            self(*inputs)
            return time.perf_counter() - t0

    def extra_repr(self) -> str:
        if self.plan is None:
            return f"eager (fallback: {self.fallback_reason})"
        return (f"policy={self.plan.policy!r}, machine={self.machine.name!r}, ops={len(self.graph.ops)}"
                + ("" if self.scheduled else f", eager (fallback: {self.fallback_reason})"))


class ScheduledKeras(_Scheduled):
    """A Keras model whose calls run a Plan on the TensorFlow runtime
    (:mod:`opsched.backends.tf_cpu`); called with numpy arrays (one per model
    input), it returns the model's outputs as a list of numpy arrays (flattened
    as ``tf.nest.flatten`` orders them)."""

    def __init__(self, model: Any, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        self.model = model
        self.graph, self.plan, self.machine, self.policy = graph, plan, machine, policy
        self.backend = backend
        self.fallback_reason = fallback_reason
        self.example_inputs = example_inputs
        self._signature = tuple(_signature(x) for x in example_inputs)
        self._warned = set()

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
          verify: bool = True, runtime: Any = None, batch: int = 1) -> ScheduledModule | ScheduledKeras:
    """Plan ``model`` with ``policy`` and return it scheduled (see the module docstring).

    ``policy``: an exported policy's folder, a Policy, a heuristic's name, or
    None for the shipped policy.  ``model``: an ``nn.Module`` (in eval mode)
    or a built Keras model.  ``example_inputs``: a tensor or a tuple of them
    (numpy arrays for Keras; default: the importer's random inputs), with the
    shapes later calls will use.  ``backend``: ``auto`` (the model's
    framework's runtime), ``torch-cpu`` or ``tf``.  ``machine``: this machine
    by default (probed; the runtime executes here).  ``perf_model``: ``auto``,
    ``analytic``, ``fitted`` or a performance model object.  ``plan``: run
    this saved Plan instead of planning.  ``verify``: run the Plan once on the
    example inputs and compare with eager execution.  ``runtime``: an open
    backend to run on (default: one shared per process).  ``batch``: the batch
    size a Keras model is planned for when no example inputs are given.

    Never raises for a model it cannot schedule: the result then runs eagerly
    and a :class:`ScheduleFallbackWarning` says why (errors in the arguments
    themselves -- not a model, an unknown machine or backend, a saved ``plan``
    made for another graph or machine -- still raise)."""
    keras = _is_keras(model)
    if not keras and not isinstance(model, nn.Module):
        raise TypeError(f"opsched.apply: expected a torch.nn.Module or a Keras model, got {type(model).__name__}")
    name = resolve_backend(backend, "keras" if keras else "torch", type(model).__name__)
    machine = (runtime.machine if runtime is not None else get_machine(machine or "local")).cpu_only()
    if keras:
        return _apply_keras(policy, model, example_inputs, name, machine, perf_model, plan, verify, runtime, batch)
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    pol: Policy | None = None

    def fallback(reason: str, graph: OpGraph | None = None, plan: Plan | None = None) -> ScheduledModule:
        warnings.warn(f"opsched.apply: {reason}; running {type(model).__name__} eagerly",
                      ScheduleFallbackWarning, stacklevel=3)
        return ScheduledModule(model, inputs, graph=graph, plan=plan, machine=machine, policy=pol,
                               backend=None, fallback_reason=reason)

    try:
        pol = _resolve(policy, plan)
    except PolicyError as exc:
        return fallback(f"cannot use the policy: {exc}")
    if model.training:
        return fallback("the module is in training mode; call module.eval() before opsched.apply")
    from opsched.importers.torch_fx import from_torch

    try:
        graph = from_torch(model, inputs, name=type(model).__name__)
    except OpschedError as exc:
        if plan is not None:
            raise
        return fallback(f"cannot import the model: {exc}")
    if plan is not None:
        plan.validate(graph, machine)
    try:
        plan, plan_s = _plan(pol, plan, graph, machine, name, perf_model)
    except (OpschedError, ValueError) as exc:
        return fallback(f"the policy cannot plan this graph: {exc}", graph)
    be = runtime if runtime is not None else shared_backend(name, machine)
    if verify:
        try:
            with torch.no_grad():
                same = outputs_equal(be.execute(graph, plan, inputs), model(*inputs))
        except OpschedError as exc:
            return fallback(f"the scheduled run failed: {exc}", graph, plan)
        if not same:
            return fallback("the scheduled run's outputs differ from eager execution", graph, plan)
    out = ScheduledModule(model, inputs, graph=graph, plan=plan, machine=machine, policy=pol, backend=be,
                          fallback_reason=None)
    out.plan_s = plan_s
    return out


def _plan(pol: Policy | None, plan: Plan | None, graph: OpGraph, machine: Machine, backend: str,
          perf_model: PerfModel | str) -> tuple[Plan, float | None]:
    """The policy's Plan and the seconds planning took; a given saved Plan is
    validated (a plan for another graph or machine raises :class:`PlanError`:
    an argument error, not a reason to fall back)."""
    if plan is not None:
        plan.validate(graph, machine)
        return plan, None
    model = planning_model(machine, backend, perf_model) if isinstance(perf_model, str) else perf_model
    t0 = time.perf_counter()
    out = plan_cached(pol, graph, machine, model)
    seconds = time.perf_counter() - t0
    out.validate(graph, machine)
    return out, seconds


def _resolve(policy: Any, plan: Plan | None) -> Policy | None:
    return None if plan is not None else resolve_policy(policy)


def _apply_keras(policy: Any, model: Any, example_inputs: Any, backend: str, machine: Machine,
                 perf_model: PerfModel | str, plan: Plan | None, verify: bool, runtime: Any,
                 batch: int) -> ScheduledKeras:
    from opsched.importers.tf_graph import from_keras

    pol: Policy | None = None
    feeds: tuple = ()

    def fallback(reason: str, graph: OpGraph | None = None, plan: Plan | None = None) -> ScheduledKeras:
        warnings.warn(f"opsched.apply: {reason}; running {type(model).__name__} eagerly",
                      ScheduleFallbackWarning, stacklevel=4)
        return ScheduledKeras(model, feeds, graph=graph, plan=plan, machine=machine, policy=pol, backend=None,
                              fallback_reason=reason)

    given = None if example_inputs is None else (
        tuple(np.asarray(a) for a in example_inputs) if isinstance(example_inputs, (list, tuple))
        else (np.asarray(example_inputs),))
    try:
        pol = _resolve(policy, plan)
    except PolicyError as exc:
        return fallback(f"cannot use the policy: {exc}")
    try:
        graph = from_keras(model, batch=int(given[0].shape[0]) if given else batch, name=type(model).__name__)
    except OpschedError as exc:
        if plan is not None:
            raise
        return fallback(f"cannot import the model: {exc}")
    feeds = given if given is not None else tuple(graph.source.random_inputs(0))
    if plan is not None:
        plan.validate(graph, machine)
    try:
        plan, plan_s = _plan(pol, plan, graph, machine, backend, perf_model)
    except (OpschedError, ValueError) as exc:
        return fallback(f"the policy cannot plan this graph: {exc}", graph)
    be = runtime if runtime is not None else shared_backend(backend, machine)
    if verify:
        try:
            same = outputs_equal(be.execute(graph, plan, list(feeds)), keras_eager(model, feeds), TF_RTOL, TF_ATOL)
        except OpschedError as exc:
            return fallback(f"the scheduled run failed: {exc}", graph, plan)
        if not same:
            return fallback("the scheduled run's outputs differ from eager execution", graph, plan)
    out = ScheduledKeras(model, feeds, graph=graph, plan=plan, machine=machine, policy=pol, backend=be,
                         fallback_reason=None)
    out.plan_s = plan_s
    return out


__all__ = ["BACKENDS", "ScheduleFallbackWarning", "ScheduledKeras", "ScheduledModule", "apply", "keras_eager",
           "outputs_equal", "resolve_backend", "shared_backend"]
