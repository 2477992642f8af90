"""What the moldable-task heuristics share: allocations as thread levels, critical paths, list scheduling.

In the moldable-task literature an op ("task") runs on ``p`` processors of
``P`` for ``t(p)`` seconds, and a schedule first *allocates* (chooses ``p``
per op), then *list-schedules* (starts each ready op, by priority, as soon as
``p`` processors are free).  In opsched terms an allocation is a thread level
of a device, and list scheduling is exactly the plan semantics: ops dispatch
greedily by priority when their device has ``threads`` free slots.  So a
moldable heuristic's Plan is per op a device, a thread level and a priority
(the op's *bottom level*, the longest path from it to the end at the
allocated times), with no ``after`` holds.

Machines with GPUs (the heuristics are published for one pool of identical
processors): an op HEFT (:mod:`opsched.policies.heft`) would put on a GPU
keeps that GPU (one stream, its time there fixed), and the allocation runs on
the CPU ops around them; the CPU-only plan is made too, and the faster of the
two in the simulator is the answer (:func:`placements`).  A CPU with busy
cores (``Device.busy_cores``) offers its free cores: the allocations use at
most ``cores - busy_cores`` threads (:func:`free_cores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Device, Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import build_plan


def free_cores(device: Device) -> int:
    """The cores a heuristic may allocate on ``device``: all of them, less the
    ones busy with other work (at least 1)."""
    busy = float(getattr(device, "busy_cores", 0.0) or 0.0)
    return max(1, int(round(device.cores - busy)))


@dataclass
class Problem:
    """One (graph, machine) as a moldable-task instance on the CPU.

    ``times[i, l]``: op ``i``'s seconds at CPU thread level ``levels[l]``;
    ``fixed[i]``: seconds of an op placed off the CPU (NaN: it is a CPU op);
    ``P``: the CPU's free cores."""

    graph: OpGraph
    times: np.ndarray
    levels: tuple[int, ...]
    fixed: np.ndarray
    P: int
    device_of: list[str]

    @property
    def n(self) -> int:
        return len(self.graph.ops)

    def is_cpu(self, i: int) -> bool:
        return bool(np.isnan(self.fixed[i]))

    def durations(self, alloc: Sequence[int]) -> np.ndarray:
        """Each op's seconds under the level indices ``alloc`` (fixed ops: their time)."""
        t = self.times[np.arange(self.n), np.asarray(alloc)]
        return np.where(np.isnan(self.fixed), t, self.fixed)

    def area(self, alloc: Sequence[int]) -> float:
        """Processor-seconds of the CPU ops: sum of threads x time."""
        k = np.asarray(self.levels)[np.asarray(alloc)]
        t = self.times[np.arange(self.n), np.asarray(alloc)]
        return float(np.sum(np.where(np.isnan(self.fixed), k * t, 0.0)))


def cpu_problem(graph: OpGraph, machine: Machine, table: Any, placement: dict[str, str] | None = None) -> Problem:
    """The CPU moldable-task instance of ``graph``; ``placement`` maps the ops
    that run elsewhere to their GPU (they take one stream, at that GPU's time)."""
    cpu = machine.device_index["cpu"]
    dev = machine.cpu
    P = free_cores(dev)
    levels = tuple(k for k in dev.thread_levels() if k <= P) or (1,)
    times = np.stack([table.on(cpu, k) for k in levels], axis=1)
    fixed = np.full(len(graph.ops), np.nan)
    device_of = ["cpu"] * len(graph.ops)
    for i, op in enumerate(graph.ops):
        d = (placement or {}).get(op.id, "cpu")
        if d != "cpu":
            fixed[i] = table.time(i, machine.device_index[d], 1)
            device_of[i] = d
    return Problem(graph, times, levels, fixed, P, device_of)


def longest_paths(graph: OpGraph, w: np.ndarray | Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(top level, bottom level) of every op under op weights ``w`` (an array or a
    list of floats): the longest path ending just before it starts, and the
    longest from its start to the end (its own weight included)."""
    top, bottom = longest_path_lists(graph, w.tolist() if isinstance(w, np.ndarray) else list(w))
    return np.array(top), np.array(bottom)


def longest_path_lists(graph: OpGraph, w: list[float]) -> tuple[list[float], list[float]]:
    """:func:`longest_paths` as lists (CPA's loop keeps them up to date step by step:
    :func:`opsched.policies.cpa.cpa_allocations`)."""
    n = len(w)
    top, bottom = [0.0] * n, [0.0] * n
    top_levels(graph, w, top, graph.topo_index)
    bottom_levels(graph, w, bottom, graph.topo_index[::-1])
    return top, bottom


def top_levels(graph: OpGraph, w: Sequence[float], top: list[float], order: Sequence[int]) -> None:
    """Set ``top[i]`` for the ops ``order`` names, in that (topological) order, from their
    predecessors' top levels and weights: the forward pass of :func:`longest_paths`."""
    preds = graph.pred_index
    for i in order:
        best = 0.0
        for j in preds[i]:
            v = top[j] + w[j]
            if v > best:
                best = v
        top[i] = best


def bottom_levels(graph: OpGraph, w: Sequence[float], bottom: list[float], order: Sequence[int]) -> None:
    """Set ``bottom[i]`` for the ops ``order`` names, in that (reverse topological) order,
    from their successors' bottom levels: the backward pass of :func:`longest_paths`."""
    succs = graph.succ_index
    for i in order:
        best = 0.0
        for j in succs[i]:
            if bottom[j] > best:
                best = bottom[j]
        bottom[i] = w[i] + best


def list_plan(problem: Problem, machine: Machine, alloc: Sequence[int], policy: str, **meta: Any) -> Plan:
    """The list schedule of an allocation as a Plan: each op's device and thread
    level, priority its bottom level at the allocated times (ties: graph order)."""
    dur = problem.durations(alloc)
    _, bottom = longest_paths(problem.graph, dur)
    assignments = {}
    for i, op in enumerate(problem.graph.ops):
        d = problem.device_of[i]
        threads = int(problem.levels[alloc[i]]) if d == "cpu" else 1
        assignments[op.id] = Assignment(d, threads, float(bottom[i]))
    return build_plan(problem.graph, machine, assignments, policy=policy, **meta)


#: HEFT's GPU placement per (graph, machine, model): CPA, biCPA and LP rounding
#: all start from it, and planning runs them one after another on the same graph.
_PLACEMENTS = IdentityLRU(256)


def clear_placements() -> None:
    """Forget the cached GPU placements (with :func:`opsched.policies.hints.clear_cache`)."""
    _PLACEMENTS.clear()


def heft_placement(graph: OpGraph, machine: Machine, model: PerfModel | None) -> dict[str, str]:
    """The ops HEFT puts on a GPU, and which (empty on a CPU-only machine);
    computed once per (graph, machine, model) and shared (a copy each call)."""
    if not machine.gpus:
        return {}

    def make() -> dict[str, str]:
        from opsched.policies.heft import HeftPolicy

        plan = HeftPolicy().plan(graph, machine, model)
        return {k: a.device for k, a in plan.assignments.items() if a.device != "cpu"}

    owners = (graph, machine) if model is None else (graph, machine, model)
    return dict(_PLACEMENTS.get_or_make((id(graph), id(machine), id(model)), make, *owners))


def placements(graph: OpGraph, machine: Machine, model: PerfModel | None) -> list[tuple[str, dict[str, str]]]:
    """The placements a moldable heuristic tries: every op on the CPU, and on a
    machine with GPUs also HEFT's GPU ops on their GPUs."""
    out: list[tuple[str, dict[str, str]]] = [("cpu", {})]
    gpu = heft_placement(graph, machine, model)
    if gpu:
        out.append(("heft", gpu))
    return out


def simulate(graph: OpGraph, machine: Machine, model: PerfModel | None, plan: Plan) -> float:
    """``plan``'s makespan in the simulator under ``model`` (the plans' judge)."""
    from opsched.engine.sim import prepare, replay_plan_makespan

    return replay_plan_makespan(prepare(graph, machine, model), plan)


__all__ = ["Problem", "clear_placements", "cpu_problem", "free_cores", "heft_placement", "list_plan", "bottom_levels", "longest_path_lists", "longest_paths", "placements", "top_levels",
           "simulate"]
