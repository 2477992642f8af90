"""The engine's typed contracts, and the one vocabulary of opsched.

Glossary (every module, docstring and variable uses these words for these things):

network
    The user's model: an ``nn.Module``, a Keras model, an ONNX file.  Never
    called "model" in code that also holds one of the models below.
graph
    An :class:`~opsched.graph.OpGraph`: the network's ops and tensor edges as
    an importer made them (``graph.source`` runs it on a real backend).
perf model
    How long an op takes alone on a device with ``k`` threads, a transfer
    between devices, co-run slowdown (:class:`PerfModel`: the analytic model,
    the fitted model of measured profiles, the GPU model).
runtime model
    What a real backend adds beyond the ops' own times: hand-offs, OpenMP
    spin and teams, per-node overheads (:class:`RuntimeModel`; fitted per
    backend and machine by ``opsched profile``).
planning model
    A perf model joined to a backend's runtime model
    (:class:`~opsched.engine.models.runtime.PlanningModel`), or a perf model
    alone: what a policy plans with and the simulator prices a plan with
    (:func:`opsched.planning.planning_model` chooses it, once).
backend
    What executes a plan (:class:`Backend`: the simulator, torch-cpu,
    torch-cuda, tf, ort), named in :mod:`opsched.backends.registry`.  A
    :class:`RuntimeModel` is not a backend.
policy
    Anything that turns (graph, machine, planning model) into a plan: the
    heuristics (registered with roles), the exported learned policy, search.
    The SB3 object that trains a policy is the "agent" (``MaskablePPO``).
plan
    Per op a device, a thread count, a priority and ``after`` ops
    (:class:`~opsched.plan.Plan`); the one currency between policies and backends.
trace
    What a backend reports a plan did: per op its device, threads, start and
    end (:class:`~opsched.trace.Trace`; measured, or simulated).
core slot
    One CPU core (or GPU stream) a running op holds; an op with ``k`` threads
    holds ``k`` core slots.
value slot
    A position in a PyTorch runtime's flat list of tensor values
    (:class:`~opsched.importers.torch_fx.TorchSource`).
lane, segment
    On the ``ort`` backend a plan is lowered to *lanes* (threads, one per core
    slot) running *segments* (sub-models of the graph, each an ONNX Runtime
    session) in order (:mod:`opsched.backends.ort_lower`).
train / validation / test
    The three disjoint splits of graphs x machines (:mod:`opsched.agents.splits`):
    training, selection while training (the evaluations, the best model),
    and the figures quoted.

The contracts:

* :class:`PerfModel` -- how long an op takes alone on a device with ``k``
  threads, a transfer between devices, and how co-running ops slow each other
  (``opsched.engine.models.analytic.AnalyticModel``, ``opsched.engine.models.fitted.FittedModel``).
* :class:`RuntimeModel` -- what a real backend adds beyond the ops' own times:
  in-situ op costs, hand-offs between its threads, OpenMP spin windows and
  teams, launch costs.  Fitted by ``opsched profile`` per backend and machine
  (``opsched.engine.models.runtime``); the simulator takes it as a plug-in.
* :class:`Backend` -- executes a Plan (``run`` -> Trace; ``execute`` -> outputs),
  the simulator and every real runtime alike.

A performance model carries its runtime model (``runtime``; ``None`` for a
model of ops alone), so a policy and the simulator plan with one object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from opsched.graph import Op, OpGraph
    from opsched.machine import Device, Machine
    from opsched.plan import Plan
    from opsched.trace import Trace


@dataclass(frozen=True)
class TimeTable:
    """Predicted op times for one graph on one machine.

    ``times[i, d, l]``: seconds for op ``i`` on device ``d`` at thread level
    ``levels[d][l]``; ``inf`` where level ``l`` does not exist for device ``d``.
    """

    times: np.ndarray
    levels: tuple[tuple[int, ...], ...]
    device_ids: tuple[str, ...]

    @cached_property
    def level_index(self) -> tuple[dict[int, int], ...]:
        return tuple({t: k for k, t in enumerate(lv)} for lv in self.levels)

    def time(self, op_index: int, device_index: int, threads: int) -> float:
        return float(self.times[op_index, device_index, self.level_index[device_index][threads]])

    def fastest(self) -> np.ndarray:
        """Each op's fastest time over every device and thread level."""
        return self.times.min(axis=(1, 2))

    def on(self, device_index: int, threads: int) -> np.ndarray:
        """Every op's time on one device at one thread count."""
        return self.times[:, device_index, self.level_index[device_index][threads]]


@runtime_checkable
class RuntimeModel(Protocol):
    """What a real backend adds to a plan's run beyond the ops' own times.

    The four costs the simulator's event loop prices (0: not modelled; see
    :mod:`opsched.engine.sim`): ``handoff_s`` waking a sleeping executor
    thread an op is handed to; ``spin_s`` how long an OpenMP team's helpers
    keep spinning on cores after a parallel region; ``team_overhead_s`` a
    multi-threaded op's cost once several threads hold OpenMP teams;
    ``thread_switch_s`` waking an idle OpenMP team."""

    #: One per kind of runtime model (``torch-cpu-runtime``) and the backend it models.
    name: ClassVar[str]
    backend: ClassVar[str]

    # Read-only members (properties): a frozen dataclass field or a plain attribute provides one.
    @property
    def handoff_s(self) -> float: ...
    @property
    def spin_s(self) -> float: ...
    @property
    def team_overhead_s(self) -> float: ...
    @property
    def thread_switch_s(self) -> float: ...

    def op_times(self, graph: OpGraph, machine: Machine, table: TimeTable) -> TimeTable:
        """The ops' times inside a run, from their profiled (alone, in a loop) ``table``."""
        ...

    def op_time(self, op: Op, device: Device, alone_s: float) -> float:
        """One op's time inside a run from its alone time (all its weights cold)."""
        ...

    def corun_slowdown(self, device: Device, factors: Sequence[float], times: Sequence[float]) -> list[float]:
        """Slowdown factors of ops co-running on ``device``, from the performance
        model's ``factors`` and each op's alone seconds ``times``."""
        ...

    def opens_parallel_region(self, op: Op) -> bool:
        """Whether a multi-threaded run of ``op`` enters an OpenMP parallel region."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (saved beside the profiles)."""
        ...


@runtime_checkable
class PerfModel(Protocol):
    """How long ops take: alone, in transfers, and co-running."""

    @property
    def name(self) -> str: ...
    @property
    def runtime(self) -> RuntimeModel | None:
        """What a real backend adds (None: the ops alone)."""
        ...

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        """Seconds of ``op`` alone on ``device`` with ``threads``."""
        ...

    def time_table(self, graph: OpGraph, machine: Machine) -> TimeTable:
        """Every op x device x thread level of ``machine``."""
        ...

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        """Seconds to move ``nbytes`` from device ``src`` to ``dst``."""
        ...

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        """Co-run interference: factors >= 1 of ops computing together on
        ``device``, from each one's alone memory-bandwidth demand (GB/s)."""
        ...

    def occupancy(self, op: Op, device: Device) -> float:
        """The share of a GPU's compute ``op`` fills alone (0 on a CPU): ops on
        concurrent streams whose shares add up to more than 1 share the GPU."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Executes Plans on one machine: the simulator or a real runtime.

    ``run`` validates the plan against the graph and the machine (a plan for
    another graph or machine raises :class:`~opsched.errors.PlanError`) and
    returns what happened; ``execute`` returns the model's outputs for
    ``inputs``.  Real backends hold threads or processes until ``close()``
    (they are context managers)."""

    @property
    def name(self) -> str: ...
    @property
    def measured(self) -> bool:
        """True when ``run`` measures real time (so results vary run to run)."""
        ...
    @property
    def machine(self) -> Machine: ...

    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any] | None = None) -> Trace:
        """Execute ``plan`` (on ``inputs``, default the graph's example inputs) and return its Trace."""
        ...

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> Any:
        """Execute ``plan`` on ``inputs`` and return the model's outputs."""
        ...

    def close(self) -> None:
        """Release threads, processes and devices (idempotent)."""
        ...

    def __enter__(self) -> Backend:
        """``with get_backend(...) as backend:`` closes it on leaving."""
        ...

    def __exit__(self, *exc: object) -> None:
        """Calls :meth:`close`."""
        ...


@runtime_checkable
class WorkerProcesses(Protocol):
    """A backend whose ops run in worker processes (``tf``): their CPU time is the
    backend's own, not other processes' load (``opsched.timing.interleave(pids=...)``)."""

    def worker_pids(self) -> list[int]:
        """The process ids of the live workers."""
        ...


__all__ = ["Backend", "PerfModel", "RuntimeModel", "TimeTable", "WorkerProcesses"]
