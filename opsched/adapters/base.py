"""What every framework adapter shares: the output check, fallback reasons, the scheduled-model base.

An adapter (:class:`Adapter`) is the small per-framework part of the one
apply pipeline (:mod:`opsched.scheduled`): how to import a network into an
OpGraph for its backend, what inputs that backend runs, what the scheduled
outputs must equal and within which tolerance, which plans to time before
choosing, what configurations the framework runs on its own (the rows
``opsched apply`` times against), and the object the user gets back.  The
pipeline does everything else once, in one order, for every backend:
import -> plan -> time the shortlist -> check once against the reference ->
wrap -> fall back with a :class:`Fallback` saying why.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend, PerfModel
    from opsched.policies.base import Policy


class ScheduleFallbackWarning(UserWarning):
    """The scheduled path is not used (the message says why); the model runs eagerly."""


class FallbackReason(str, Enum):
    """Why a scheduled model runs eagerly (at apply time, or for one call)."""

    POLICY = "policy"                  # the policy cannot be used (a broken or mismatched export)
    TRAINING_MODE = "training-mode"    # the module is in training mode
    IMPORT = "import"                  # the network cannot be imported (traced, exported, parsed)
    EXPORT_DIFFERS = "export-differs"  # the exported ONNX model's outputs differ from the module's
    PLAN = "plan"                      # the policy cannot plan this graph
    MEMORY = "memory"                  # no plan keeps the activations under the memory cap
    FRAMEWORK_FASTER = "framework-faster"  # the framework's own run was faster here, timed against the plan
    RUN_FAILED = "run-failed"          # the scheduled run raised
    OUTPUTS_DIFFER = "outputs-differ"  # the scheduled run's outputs differ from the reference
    INPUTS_DIFFER = "inputs-differ"    # a call's inputs differ from the planned ones
    KEYWORDS = "keywords"              # a call passed keyword arguments
    REQUIRES_GRAD = "requires-grad"    # a call's input requires grad (the path is inference only)


@dataclass(frozen=True)
class Fallback:
    """A reason and its sentence (``str(fallback)`` is the sentence)."""

    reason: FallbackReason
    detail: str

    def __str__(self) -> str:
        return self.detail


#: A configuration to time: a callable returning the seconds of one call, what it runs in words,
#: and whether its outputs equal the reference's.
@dataclass(frozen=True)
class Config:
    timer: Callable[[], float]
    description: str
    outputs_equal: bool = True


# ------------------------------------------------------------------ checks
def outputs_equal(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Same structure, and every tensor or array of the same shape and dtype and allclose."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and (isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor)):
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.device != want.device:
            got = got.to(want.device)  # a CUDA run's outputs against the CPU module's
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
    return bool(got == want)


def signature(x: Any) -> tuple:
    """What a call's input must match: kind, shape, dtype and device of a tensor or array, else its value."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "device") and hasattr(x, "requires_grad"):
        return ("tensor", tuple(x.shape), str(x.dtype).removeprefix("torch."), x.device.type)
    if isinstance(x, np.ndarray):
        return ("array", tuple(x.shape), str(x.dtype), "cpu")
    return ("value", type(x).__name__, repr(x))


def describe_signature(sig: tuple) -> str:
    return "(" + ", ".join(f"{s[2]}{list(s[1])}@{s[3]}" if s[0] != "value" else f"{s[1]} {s[2]}"
                           for s in sig) + ")"


# --------------------------------------------------------- scheduled models
class Scheduled:
    """What every scheduled model holds: its graph, plan, machine, policy, backend,
    and why it runs eagerly (``fallback``; None while scheduled)."""

    graph: OpGraph | None
    plan: Plan | None
    #: Every scheduled model is called like the network (nn.Module's ``__call__``, or the
    #: subclass's own); declared only, so no subclass's ``__call__`` is shadowed.
    __call__: Callable[..., Any]
    #: Seconds the policy took to plan, timing its candidates included (None: a saved plan, or no plan).
    plan_s: float | None = None
    machine: Machine
    policy: Policy | None
    backend: Backend | None
    fallback: Fallback | None
    example_inputs: tuple
    _signature: tuple
    _warned: set[FallbackReason]

    def _hold(self, example_inputs: tuple, graph: OpGraph | None, plan: Plan | None, machine: Machine,
              policy: Policy | None, backend: Backend | None, fallback: Fallback | None) -> None:
        self.graph, self.plan, self.machine, self.policy = graph, plan, machine, policy
        self.backend = backend
        self.fallback = fallback
        self.example_inputs = example_inputs
        self._signature = tuple(signature(x) for x in example_inputs)
        self._warned = set()

    @property
    def scheduled(self) -> bool:
        """True while calls with the planned inputs run the Plan."""
        return self.fallback is None

    @property
    def fallback_reason(self) -> str | None:
        """Why it runs eagerly, in words (None while scheduled)."""
        return None if self.fallback is None else self.fallback.detail

    def _warn_once(self, why: Fallback, what: str) -> None:
        if why.reason not in self._warned:
            self._warned.add(why.reason)
            warnings.warn(f"opsched.apply: {why}; running {what} eagerly", ScheduleFallbackWarning, stacklevel=4)

    def _why_inputs(self, args: Sequence[Any]) -> Fallback | None:
        sig = tuple(signature(x) for x in args)
        if sig != self._signature:
            return Fallback(FallbackReason.INPUTS_DIFFER,
                            f"the inputs {describe_signature(sig)} differ from the planned "
                            f"{describe_signature(self._signature)} (apply again with example inputs of the new shape)")
        return None

    def time_call(self, *inputs: Any) -> float:
        """Wall seconds of one call."""
        t0 = time.perf_counter()
        self(*inputs)
        return time.perf_counter() - t0

    def _repr(self, what: str = "") -> str:
        if self.plan is None or self.graph is None:
            return f"eager (fallback: {self.fallback_reason})"
        return (f"policy={self.plan.policy!r}{what}, machine={self.machine.name!r}, ops={len(self.graph.ops)}"
                + ("" if self.scheduled else f", eager (fallback: {self.fallback_reason})"))


# ------------------------------------------------------------------ adapter
class Adapter(ABC):
    """How the apply pipeline schedules a network of one framework on one backend.

    Subclasses set :attr:`framework` and :attr:`tolerance` and implement the
    import, the reference, the wrapper and the framework's own configurations.
    ``network``: the user's object; ``inputs``: example inputs as given (may be
    empty: the adapter then makes them)."""

    #: The network framework this adapter takes ("torch", "keras", "onnx").
    framework: str = ""
    #: (rtol, atol) of the scheduled outputs against :meth:`reference`.
    tolerance: tuple[float, float] = (1e-4, 1e-5)
    #: Candidates always timed in a measured choice (when they are candidates).
    always_time: tuple[str, ...] = ("heuristic:sequential",)

    def __init__(self, network: Any, inputs: tuple, backend: str, batch: int = 1) -> None:
        self.network = network
        self.inputs = inputs
        self.backend_name = backend
        self.batch = batch

    @property
    def label(self) -> str:
        """The network's name in messages."""
        return type(self.network).__name__

    def refuse(self) -> Fallback | None:
        """Why this network cannot be scheduled at all before importing it (None: go on)."""
        return None

    @abstractmethod
    def import_graph(self) -> OpGraph:
        """The OpGraph the backend runs (OpschedError when the network cannot be imported)."""

    def feeds(self, graph: OpGraph) -> tuple:
        """The inputs the backend runs the graph on (the example inputs, or ones the import made)."""
        return self.inputs

    @abstractmethod
    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        """What a scheduled run on ``feeds`` must return: the framework's own execution."""

    def check_import(self, graph: OpGraph, feeds: tuple) -> Fallback | None:
        """A check of the imported graph itself before planning (the ONNX export's outputs); None: fine."""
        return None

    def check_run(self, backend: Backend, graph: OpGraph, plan: Plan, feeds: tuple, reference: Any) -> str | None:
        """Run ``plan`` once and say why its result differs from ``reference`` (None: it does not)."""
        try:
            import torch

            grad: Any = torch.no_grad()
        except ImportError:  # pragma: no cover
            import contextlib

            grad = contextlib.nullcontext()
        with grad:
            got = backend.execute(graph, plan, feeds)
        if outputs_equal(got, reference, *self.tolerance):
            return None
        return "the scheduled run's outputs differ from the reference (eager) run"

    def choose(self, graph: OpGraph, plan: Plan, found: dict[str, tuple[Plan, float]] | None, machine: Machine,
               model: PerfModel, policy: Policy | None) -> tuple[Plan, dict[str, tuple[Plan, float]] | None]:
        """The plan the planning model picks for this backend and the candidates a measured choice
        times (None: nothing to time).  Default: the policy's plan and candidates as they are."""
        return plan, found

    def prepare_backend(self, backend: Backend, model: PerfModel) -> None:  # noqa: B027 - a hook, empty by default
        """Set up an open backend before runs (default: nothing)."""

    def eager_description(self) -> str:
        """What runs when the model falls back, for warnings."""
        return self.label

    def against_framework(self, scheduled: Scheduled) -> Fallback | None:
        """After the measured choice: a reason to run the framework itself instead, when timing it
        against the kept plan here says it is faster (None: keep the plan; default: not timed)."""
        return None

    @abstractmethod
    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        """The object ``opsched.apply`` returns."""

    @abstractmethod
    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        """The framework's own configurations ``opsched apply`` times the plans against (the first
        is the reference row), their outputs checked against :meth:`reference` like a plan's."""

    def timer(self, scheduled: Scheduled, feeds: tuple) -> Callable[[], float]:
        """Seconds of one call of the scheduled model on ``feeds``."""
        return lambda: scheduled.time_call(*feeds)

    def note(self) -> str | None:
        """A sentence ``opsched apply`` prints about what '= eager' means on this backend."""
        return None


def describe_plan(plan: Plan | None) -> str:
    """Threads used and how many ops wait for another, in a few words."""
    if plan is None:
        return "-"
    threads = sorted({a.threads for a in plan.assignments.values()})
    waits = sum(1 for a in plan.assignments.values() if a.after)
    return f"threads {'/'.join(map(str, threads))}" + (f", {waits} holds" if waits else "")


def merged_meta(plan: Plan, **meta: Any) -> Plan:
    """``plan`` with ``meta`` added to its meta."""
    return Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint, plan.policy,
                {**dict(plan.meta), **meta})


Candidates = Mapping[str, tuple[Plan, float]]

__all__ = ["Adapter", "Candidates", "Config", "Fallback", "FallbackReason", "ScheduleFallbackWarning", "Scheduled",
           "describe_plan", "describe_signature", "merged_meta", "outputs_equal", "signature"]
