"""CPA: Critical Path and Area-based scheduling (Radulescu and van Gemund, ICPP 2001).

A two-step moldable-task heuristic:

1. *Allocation*: every op starts on one processor.  While the critical path
   ``T_CP`` (the longest path at the allocated times) is longer than the
   average area ``T_A = sum_i p_i t_i(p_i) / P`` (the makespan if the work
   spread perfectly over the ``P`` processors), the op on the critical path
   that gains most from one more processor, ``t(p)/p - t(p+1)/(p+1)``, gets
   it.  The loop stops where the two lower bounds meet: longer paths would
   leave processors idle, more area would queue ops.
2. *List scheduling*: ops by decreasing bottom level, each started as soon as
   its processors are free.

In opsched an allocation step is the next thread level of the CPU (the levels
a plan uses, :meth:`~opsched.machine.Device.thread_levels`) that makes the op
faster -- thread scaling is not always monotone here (a team's sync overhead
grows with it), so a level that would slow the op down is skipped and an op
with no faster level left is saturated.  The gain is the paper's, per level
step.  List scheduling is the plan semantics (:mod:`opsched.policies.moldable`);
GPUs and busy cores as described there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import add
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import MODEL_MAKESPAN, Policy, build_plan
from opsched.policies.moldable import (
    Problem,
    bottom_levels,
    cpu_problem,
    list_plan,
    longest_path_lists,
    placements,
    simulate,
    top_levels,
)
from opsched.policies.registry import BASELINE, HINT, register


def next_level(problem: Problem, i: int, a: int, cap: int) -> int | None:
    """The smallest level index above ``a``, at most ``cap`` threads, at which op
    ``i`` runs faster than at ``a`` (None: none is)."""
    t = problem.times[i]
    for b in range(a + 1, len(problem.levels)):
        if problem.levels[b] > cap:
            return None
        if t[b] < t[a]:
            return b
    return None


def cpa_allocation(problem: Problem, processors: int | None = None, cap: int | None = None) -> list[int]:
    """CPA's allocation phase: a thread-level index per op.

    ``processors``: the ``P`` of the average area (default: the free cores);
    ``cap``: the most threads an op may get (default ``P``).  biCPA asks for
    many ``P' = processors = cap`` at once (:func:`cpa_allocations`)."""
    P = problem.P if processors is None else int(processors)
    cap = P if cap is None else int(cap)
    if cap == P:
        return cpa_allocations(problem, (P,))[P]
    out: dict[int, list[int]] = {}
    _allocate(problem, *_start(problem), [(P, cap)], out)
    return out[P]


def cpa_allocations(problem: Problem, caps: Sequence[int]) -> dict[int, list[int]]:
    """CPA's allocation for every ``c`` in ``caps`` with ``processors = cap = c``
    (biCPA's ``P'``), computed in one pass with the others branching off it.

    The run for a smaller ``c`` takes the same steps as the run for the
    largest until one of two things happens: its average area ``area / c``
    reaches the critical path first (it stops there: the larger run's state
    at that step *is* its allocation), or the larger run gives some op more
    than ``c`` threads (the smaller run, whose ops saturate at ``c``, would
    have chosen another op: it branches off with a copy of the state and goes
    on alone, carrying the caps smaller than it).  Until then both runs see
    the same durations, area and critical ops, and the larger run's choice is
    one the smaller's candidates hold with the same gain, so the smaller
    would have made it too (the first op of maximal gain: the same op).
    The result is exactly :func:`cpa_allocation`'s per cap (a test checks it
    against the paper's loop).  With the top and bottom levels kept up to date
    (:func:`_repath`) and the gains cached per op, biCPA's allocations on the
    planning benchmark's 150-200-op graphs on a 56- and a 68-core preset take
    x3.2-x11 less time (median x4.8; resnet50's 174 ops on the Xeon 178 ->
    22 ms) and whole biCPA plans 12-29 ms instead of 20-200 (``python
    bench/moldable_speed.py``, docs/bench/moldable_speed.md)."""
    wanted = sorted({int(c) for c in caps}, reverse=True)
    out: dict[int, list[int]] = {}
    if wanted:
        _allocate(problem, *_start(problem), [(c, c) for c in wanted], out)
    return out


def _start(problem: Problem) -> tuple[list[int], list[float], np.ndarray, list[float], list[float]]:
    """Every op at level 0: the allocation, its durations, the area's terms and
    the top and bottom levels."""
    alloc = [0] * problem.n
    dur = problem.durations(alloc).tolist()
    work = np.where(np.isnan(problem.fixed), problem.levels[0] * problem.times[:, 0], 0.0)
    return (alloc, dur, work, *longest_path_lists(problem.graph, dur))


def _allocate(problem: Problem, alloc: list[int], dur: list[float], work: np.ndarray, top: list[float],
              bottom: list[float], runs: list[tuple[int, int]], out: dict[int, list[int]]) -> None:
    """CPA's loop from ``alloc`` for the ``(processors, cap)`` runs (caps descending,
    ``processors`` keyed into ``out``): the first run steps, the others ride along
    until they stop or branch off (see :func:`cpa_allocations`).  ``dur`` and
    ``work`` are ``problem.durations(alloc)`` and the terms of ``problem.area(alloc)``,
    ``top`` and ``bottom`` the longest paths under ``dur``, all kept up to date:
    one op changes per step (the same values, so the same sums, paths and
    allocation as recomputing them)."""
    n, levels, graph = problem.n, problem.levels, problem.graph
    times = problem.times.tolist()  # Python floats: the same quotients as numpy's, without its scalars
    cpu = [problem.is_cpu(i) for i in range(n)]
    if not any(cpu):
        for P, _ in runs:
            out[P] = list(alloc)
        return
    P, cap = runs[0]
    riders = runs[1:]  # stop or branch off before the leading run does
    nxt = [next_level(problem, i, alloc[i], cap) if cpu[i] else None for i in range(n)]

    def gain(i: int) -> float:  # the paper's t(p)/p - t(p')/p' for op i's next level (-inf: none)
        b = nxt[i]
        if b is None:
            return -math.inf
        a = alloc[i]
        return times[i][a] / levels[a] - times[i][b] / levels[b]

    gains = [gain(i) for i in range(n)]
    while True:
        through = list(map(add, top, bottom))
        t_cp = max(through)
        area = float(np.sum(work))
        while riders and t_cp <= area / riders[-1][0]:  # the smallest P' stops first
            out[riders.pop()[0]] = list(alloc)
        if t_cp <= area / P:
            break
        floor = t_cp * (1.0 - 1e-12)
        best, best_gain = -1, -math.inf
        for i, v in enumerate(through):
            if v >= floor and gains[i] > best_gain:  # the first critical op of the largest gain
                best, best_gain = i, gains[i]
        if best < 0:  # every critical op is saturated: more processors cannot shorten the path
            break
        a = nxt[best]
        assert a is not None  # best was chosen among ops with a next level
        if riders and levels[a] > riders[-1][1]:  # beyond these riders' caps: they go on alone
            off = [r for r in riders if levels[a] > r[1]]
            riders = riders[:len(riders) - len(off)]
            _allocate(problem, list(alloc), list(dur), work.copy(), list(top), list(bottom), off, out)
        alloc[best] = a
        t = times[best][a]
        dur[best], work[best] = t, levels[a] * t
        nxt[best] = next_level(problem, best, a, cap)
        gains[best] = gain(best)
        _repath(graph, dur, top, bottom, best)
    for Q, _ in (*riders, runs[0]):  # saturated with the leader, or stopped with it
        out[Q] = list(alloc)


def _repath(graph: OpGraph, w: list[float], top: list[float], bottom: list[float], changed: int) -> None:
    """Bring ``top`` and ``bottom`` (:func:`~opsched.policies.moldable.longest_path_lists`
    of ``w`` before op ``changed``'s weight changed) up to date, in place.  Only the ops after ``changed`` in the
    topological order can have a new top level, and only it and the ops before it
    a new bottom level: the forward pass runs over that suffix and the backward
    pass over that prefix, each op recomputed by the full pass's own formula from
    its neighbours' final values.  So the values are exactly a full pass's, for
    half its work on average.  (A worklist that follows only the values that move
    does less on a wide graph but more on a long chain, where a shorter op moves
    every level after it: resnet50's 174 ops, 1.3x slower.)"""
    order = graph.topo_index
    k = _topo_position(graph)[changed]
    top_levels(graph, w, top, order[k + 1:])
    bottom_levels(graph, w, bottom, order[k::-1])


def _topo_position(graph: OpGraph) -> list[int]:
    """Each op's index in ``graph.topo_index`` (cached on the graph's identity by the caller's lifetime)."""
    cached = _POSITIONS.get(id(graph))
    if cached is None or cached[0] is not graph:
        pos = [0] * len(graph.ops)
        for k, i in enumerate(graph.topo_index):
            pos[i] = k
        cached = _POSITIONS[id(graph)] = (graph, pos)
        while len(_POSITIONS) > 64:
            _POSITIONS.pop(next(iter(_POSITIONS)))
    return cached[1]


_POSITIONS: dict[int, tuple[OpGraph, list[int]]] = {}


def moldable_plan(graph: OpGraph, machine: Machine, model: PerfModel | None, name: str,
                  allocate: Any) -> tuple[Plan, dict[str, float]]:
    """The fastest (simulated) list plan over :func:`~opsched.policies.moldable.placements`
    and the allocations ``allocate(problem)`` yields as ``(label, alloc)``; and
    every candidate's makespan by label."""
    from opsched.engine.sim import prepare

    table = prepare(graph, machine, model).table
    best: tuple[float, Plan] | None = None
    spans: dict[str, float] = {}
    for where, placement in placements(graph, machine, model):
        problem = cpu_problem(graph, machine, table, placement)
        seen: dict[tuple[int, ...], float] = {}  # biCPA's caps often agree: one simulation per allocation
        for label, alloc in allocate(problem):
            key = f"{where}:{label}"
            if tuple(alloc) in seen:
                spans[key] = seen[tuple(alloc)]  # the same plan, the same makespan: it cannot win the tie
                continue
            plan = list_plan(problem, machine, alloc, name)
            spans[key] = seen[tuple(alloc)] = simulate(graph, machine, model, plan)
            if best is None or spans[key] < best[0]:
                best = (spans[key], Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint,
                                         name, {"chosen": key, MODEL_MAKESPAN: spans[key]}))
    assert best is not None
    return best[1], spans


@register("cpa", roles=(BASELINE, HINT), order=7)
class CPA(Policy):
    """Radulescu and van Gemund's CPA (see the module docstring)."""

    name = "cpa"

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        plan, spans = moldable_plan(graph, machine, model, self.name,
                                    lambda problem: [(f"P={problem.P}", cpa_allocation(problem))])
        return build_plan(graph, machine, plan.assignments, policy=self.name, **plan.meta, candidates=spans)


__all__ = ["CPA", "cpa_allocation", "cpa_allocations", "moldable_plan", "next_level"]
