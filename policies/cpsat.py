"""CP-SAT as a policy: the incumbent of :func:`opsched.engine.bounds.cpsat_schedule`.

Not a heuristic (it spends ``time_limit_s`` seconds of CP-SAT per graph, so
``"all"`` leaves it out, like ``search``), but a Plan like every other
policy's, so ``opsched compare -p all,cpsat`` runs it on any backend.  The
search is seeded with the best heuristic's schedule
(:func:`opsched.policies.hints.best_heuristic`) and told the allocation LP's
bound, so its plan is never slower than that heuristic under the planning
model (the better of the two is returned) and an incumbent that meets the
bound is proved optimal at once.  ``plan.meta`` carries CP-SAT's status,
its proven ``lower_bound_s`` and the LP's ``lp_bound_s``.  Needs OR-Tools
(``pip install 'opsched[bench]'``); graphs above ``max_ops`` ops raise.
"""

from __future__ import annotations

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import Policy, build_plan
from opsched.policies.registry import register


@register("cpsat", roles=(), order=51)
class CpSat(Policy):
    """CP-SAT's schedule within a time limit (see the module docstring)."""

    name = "cpsat"

    def __init__(self, time_limit_s: float = 10.0, workers: int = 1, seed: int = 0, max_ops: int = 400) -> None:
        if not time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
        self.time_limit_s = float(time_limit_s)
        self.workers = int(workers)
        self.seed = int(seed)
        self.max_ops = int(max_ops)

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        from opsched.engine.bounds import allocation_lp_bound, cpsat_schedule
        from opsched.policies.hints import best_heuristic

        name, hint, hint_s = best_heuristic(graph, machine, model)
        lp = allocation_lp_bound(graph, machine, model)
        res = cpsat_schedule(graph, machine, model, self.time_limit_s, hint=hint, lower_bound=lp,
                             workers=self.workers, seed=self.seed, max_ops=self.max_ops)
        meta = {"cp_status": res.status, "optimal": res.optimal, "lower_bound_s": max(res.lower_bound_s, lp),
                "lp_bound_s": lp, "cp_makespan_s": res.cp_makespan_s, "time_limit_s": self.time_limit_s}
        if res.plan is None or res.makespan_s > hint_s:
            return build_plan(graph, machine, hint.assignments, policy=self.name, chosen=f"heuristic:{name}",
                              predicted_makespan=hint_s, **meta)
        return build_plan(graph, machine, res.plan.assignments, policy=self.name, chosen="cpsat",
                          predicted_makespan=res.makespan_s, **meta)


__all__ = ["CpSat"]
