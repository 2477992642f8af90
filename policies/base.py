"""The scheduler interface: a policy turns (graph, machine, model) into a Plan.

Every decision-maker in opsched -- the heuristic baselines, the Optuna search
and the exported learned policy -- implements :class:`Policy`, so a comparison
always runs identical :class:`~opsched.plan.Plan` objects through identical
backends.  The helpers here are the small pieces several baselines share:
the framework's default device, topological priorities and ``after`` chains
(the only way the plan semantics can force "one op at a time" or "one stream
per device").
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Device, Machine
from opsched.plan import Assignment, Plan


class Policy(ABC):
    """Something that decides, for every op, its device, threads and priority.

    Subclasses set ``name`` (the registry name) and implement :meth:`plan`.
    ``model`` is the planning model (a :class:`~opsched.engine.contracts.PerfModel`:
    ``time_table``, ``op_time``, ``transfer_time``); ``None`` means the
    analytic default, so a policy runs on any graph and preset machine.
    """

    name: str = "policy"

    @abstractmethod
    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        """Return a validated Plan for ``graph`` on ``machine``."""

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def build_plan(graph: OpGraph, machine: Machine, assignments: Mapping[str, Assignment], policy: str = "",
               **meta: Any) -> Plan:
    """:meth:`Plan.build` with the graph's and machine's fingerprints computed
    once per object: a fingerprint hashes the whole graph, which would cost
    more than planning itself for policies that build many candidate plans."""
    from opsched.engine.sim import cached_fingerprint, plan_fingerprint

    plan = Plan(dict(assignments), cached_fingerprint(graph), plan_fingerprint(machine), policy, meta)
    plan.validate(graph, machine, check_fingerprints=False)
    return plan


def resolve_model(model: PerfModel | None = None) -> PerfModel:
    """The given performance model, or the analytic default (imported lazily)."""
    if model is not None:
        return model
    from opsched.engine.models.analytic import default_model

    return default_model()


def timed_plan(policy: Policy, graph: OpGraph, machine: Machine,
               model: PerfModel | None = None) -> tuple[Plan, float]:
    """Plan and report how long deciding took (seconds, wall clock)."""
    t0 = time.perf_counter()
    plan = policy.plan(graph, machine, model)
    return plan, time.perf_counter() - t0


def default_device(machine: Machine) -> Device:
    """Where a framework puts an unannotated graph: GPU 0 when there is one
    (``model.cuda()``, TensorFlow's soft placement), else the CPU."""
    return machine.gpus[0] if machine.gpus else machine.cpu


def full_threads(device: Device) -> int:
    """An op's thread count when it may use the whole device (GPUs: 1 stream)."""
    return 1 if device.is_gpu else device.cores


def snap_threads(device: Device, threads: int) -> int:
    """The largest thread level of ``device`` that is <= ``threads`` (at least 1)."""
    levels = device.thread_levels()
    ok = [t for t in levels if t <= threads]
    return ok[-1] if ok else levels[0]


def topo_priorities(graph: OpGraph, order: Sequence[int] | None = None) -> np.ndarray:
    """Priorities that make ``order`` (default: topological) the dispatch order:
    the first op gets ``n``, the last ``1``."""
    order = graph.topo_index if order is None else order
    n = len(graph.ops)
    prio = np.zeros(n)
    for k, i in enumerate(order):
        prio[i] = float(n - k)
    return prio


def window_after(graph: OpGraph, order: Sequence[int], window: int) -> list[tuple[str, ...]]:
    """``after`` lists that allow at most ``window`` ops of ``order`` to run at once.

    Op ``order[k]`` waits for ``order[k - window]``.  If two ops ``a < b`` (in
    ``order``) run together, every op up to ``b - window`` has finished, so
    ``b - a < window``: at most ``window`` ops are in flight.  ``window = 1`` is
    a plain chain (strictly one at a time).  ``order`` must be topological so
    the extra dependencies cannot deadlock.
    """
    after: list[tuple[str, ...]] = [() for _ in graph.ops]
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for k in range(window, len(order)):
        after[order[k]] = (graph.ops[order[k - window]].id,)
    return after


def lane_after(graph: OpGraph, lanes: Sequence[Sequence[int]]) -> list[tuple[str, ...]]:
    """``after`` lists that run each lane's ops one after another, in the given
    order (a CUDA stream, or a static executor).  Each lane must list its ops in
    an order consistent with the graph's dependencies."""
    after: list[tuple[str, ...]] = [() for _ in graph.ops]
    for lane in lanes:
        for prev, cur in zip(lane, lane[1:]):
            after[cur] = (graph.ops[prev].id,)
    return after


#: The ``Plan.meta`` key under which a heuristic that simulated the plan it returns records
#: that makespan, under the model it was given (``Simulator(machine, model).makespan``, the
#: same value): :func:`opsched.policies.hints.heuristic_plans` and the exported scheduler's
#: candidates then need not simulate it again.
MODEL_MAKESPAN = "model_makespan"


def makespan_of(sim: Any, graph: OpGraph, plan: Plan, validate: bool = True) -> float:
    """``plan``'s makespan under ``sim`` (a :class:`~opsched.engine.sim.Simulator`, the model the
    plan was made with): the one its heuristic recorded (:data:`MODEL_MAKESPAN`), else simulated."""
    known = plan.meta.get(MODEL_MAKESPAN)
    return sim.makespan(graph, plan, validate=validate) if known is None else float(known)


#: A split (an executor size a heuristic tries) is skipped only when its bound exceeds the best
#: makespan found by more than this share, so float rounding in the bound never drops the split
#: trying every split would pick.
PRUNE_RTOL = 1e-9


def split_bound(rank: np.ndarray, times: np.ndarray, executors: int) -> float:
    """A lower bound on the makespan of any schedule that runs at most ``executors`` ops at a
    time with op times ``times`` (``rank``: the upward ranks from them): the critical path,
    and the work over the executors.  It holds in the simulator and in HEFT's list schedule,
    where co-running, transfers and runtime costs only ever lengthen an op; critical-path-first
    and HEFT skip the executor sizes it rules out."""
    cp = float(rank.max()) if len(rank) else 0.0
    return max(cp, float(times.sum()) / max(1, executors))
