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

from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import MODEL_MAKESPAN, Policy, build_plan
from opsched.policies.moldable import Problem, cpu_problem, list_plan, longest_paths, placements, simulate
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
    ``cap``: the most threads an op may get (default ``P``).  biCPA calls this
    with smaller ``processors`` and ``cap``."""
    P = problem.P if processors is None else int(processors)
    cap = P if cap is None else int(cap)
    n = problem.n
    alloc = [0] * n
    cpu = [problem.is_cpu(i) for i in range(n)]
    levels = problem.levels
    if not any(cpu):
        return alloc
    # each op's next useful level, refreshed when it changes
    nxt = [next_level(problem, i, 0, cap) if cpu[i] else None for i in range(n)]
    # problem.durations(alloc) and the terms of problem.area(alloc), kept up to date: one op
    # changes per step (the same values, so the same sums and the same allocation)
    dur = problem.durations(alloc).tolist()
    work = np.where(np.isnan(problem.fixed), levels[0] * problem.times[:, 0], 0.0)  # every op at level 0
    while True:
        top, bottom = longest_paths(problem.graph, dur)
        t_cp = float(np.max(top + bottom))
        t_a = float(np.sum(work)) / P
        if t_cp <= t_a:
            break
        on_cp = np.nonzero(top + bottom >= t_cp * (1.0 - 1e-12))[0]
        best, best_gain = -1, -np.inf
        for i in on_cp:
            b = nxt[i]
            if b is None:
                continue
            a = alloc[i]
            gain = problem.times[i, a] / levels[a] - problem.times[i, b] / levels[b]
            if gain > best_gain:
                best, best_gain = int(i), gain
        if best < 0:  # every critical op is saturated: more processors cannot shorten the path
            break
        a = nxt[best]
        assert a is not None  # best was chosen among ops with a next level
        alloc[best] = a
        t = problem.times[best, a]
        dur[best], work[best] = float(t), levels[a] * t
        nxt[best] = next_level(problem, best, a, cap)
    return alloc


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
        for label, alloc in allocate(problem):
            plan = list_plan(problem, machine, alloc, name)
            key = f"{where}:{label}"
            spans[key] = simulate(graph, machine, model, plan)
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


__all__ = ["CPA", "cpa_allocation", "moldable_plan", "next_level"]
