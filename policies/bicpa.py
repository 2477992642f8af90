"""biCPA: the bi-criteria CPA of Desprez and Suter (CCGrid 2010).

CPA's stopping rule ``T_CP <= T_A`` with ``T_A`` over all ``P`` processors
tends to over-allocate: wide teams shorten the critical path but fill the
machine, and the list schedule then queues what could have co-run.  biCPA
runs CPA's allocation once per processor count ``P' = 1 .. P`` -- the average
area over ``P'`` (``T_A = area / P'``) and no op above ``P'`` processors --
list-schedules each allocation on all ``P`` processors, and keeps the best
schedule (Desprez and Suter pick on makespan and work; opsched plans for the
makespan, simulated under the planning model).

``P'`` ranges over the CPU's thread levels (1, 2, 4, ..., P), which include
``P`` itself: that candidate is exactly CPA's plan, so biCPA is never slower
than CPA under the model it plans with (ties go to CPA).  GPUs and busy cores
as in :mod:`opsched.policies.moldable`.
"""

from __future__ import annotations

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import Policy, build_plan
from opsched.policies.cpa import cpa_allocations, moldable_plan
from opsched.policies.moldable import Problem
from opsched.policies.registry import BASELINE, register


def bicpa_allocations(problem: Problem) -> list[tuple[str, list[int]]]:
    """CPA's allocation for every cap ``P'`` (the thread levels up to ``P``), ``P' = P`` (CPA) first."""
    caps = [problem.P] + [k for k in reversed(problem.levels) if k < problem.P]
    allocs = cpa_allocations(problem, caps)  # one pass, the smaller caps branching off it
    return [(f"P'={c}", allocs[c]) for c in caps]


@register("bicpa", roles=(BASELINE,), order=8)
class BiCPA(Policy):
    """Desprez and Suter's biCPA (see the module docstring)."""

    name = "bicpa"

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        plan, spans = moldable_plan(graph, machine, model, self.name, bicpa_allocations)
        return build_plan(graph, machine, plan.assignments, policy=self.name, **plan.meta, candidates=spans)


__all__ = ["BiCPA", "bicpa_allocations"]
