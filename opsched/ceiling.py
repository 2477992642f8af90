"""The best known plan of a (graph, machine): what the learned policy is measured against.

:func:`best_known` runs every way opsched has to find a plan and keeps the
fastest in the simulator under the planning model:

* every registered heuristic (:func:`opsched.policies.heuristic_names`, the
  moldable-task ones included) and the shipped learned policy where it
  plans for the machine;
* CP-SAT (:func:`opsched.engine.bounds.cpsat_schedule`) on graphs up to
  ``cpsat_max_ops`` ops, seeded with the best plan so far and told the
  allocation LP's bound;
* a long Optuna search (:class:`opsched.policies.search.OptunaSearch`,
  ``search_trials`` simulations);
* local search (:func:`opsched.policies.refine.local_search`, the moves the
  exported policy refines with), ``local_steps`` simulations in restarts from
  perturbed copies (iterated local search), from each of the best plan
  found, CP-SAT's and the learned policy's.  One start only (the best so
  far) made the ceiling hang on CP-SAT's luck within its time limit: on the
  hard families' fork_join:26 CP-SAT's plan was 4% slower than the learned
  one in one run and 2% faster in another, and local search from CP-SAT's
  plan reached 0.88x the learned plan where from the learned plan it found
  nothing better.

It also returns the tightest lower bound known: the allocation LP's, CP-SAT's
proven one, whichever is larger.  The gap between the two brackets the
optimum; a heuristic's distance to the best known plan is how much room a
learned policy could still win there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.refine import iterated_slot_search


@dataclass
class BestKnown:
    """The best plan found and where it came from.

    ``makespan_s`` is its simulated makespan; ``source`` names its origin
    (``heuristic:NAME``, ``learned``, ``cpsat``, ``search``, ``local-search``);
    ``candidates`` every origin's makespan; ``lower_bound_s`` the tightest
    bound (max of ``lp_bound_s`` and CP-SAT's ``cpsat_bound_s``)."""

    plan: Plan
    makespan_s: float
    source: str
    candidates: dict[str, float]
    lower_bound_s: float
    lp_bound_s: float
    cpsat_bound_s: float = float("nan")
    cpsat_optimal: bool = False
    cpsat_status: str = "not run"
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """How far the best known plan may still be from optimal: makespan / bound."""
        return self.makespan_s / self.lower_bound_s if self.lower_bound_s > 0 else float("nan")


def _episode_data(graph: OpGraph, machine: Machine, model: PerfModel | None) -> SimpleNamespace:
    """The few fields local search reads from an episode, for the whole graph."""
    from opsched.engine.coarsen import identity
    from opsched.engine.sim import prepare

    static = prepare(graph, machine, model)
    return SimpleNamespace(graph=graph, machine=machine, static=static, n=static.n, coarsening=identity(graph))


def iterated_local_search(graph: OpGraph, machine: Machine, model: PerfModel | None, start: Plan, steps: int,
                          seed: int = 0, restarts: int = 4, kick: int = 6) -> tuple[Plan, float]:
    """``start`` improved by ``steps`` simulations of local search on the whole
    graph (:func:`iterated_slot_search`)."""
    from opsched.engine.slots import from_plan, to_plan

    data = _episode_data(graph, machine, model)
    best = from_plan(data, start, "start")
    best = iterated_slot_search(data, best, steps, np.random.default_rng(seed), restarts, kick)
    if not math.isfinite(best.makespan):
        return start, float("inf")
    return to_plan(data, best, "local-search"), float(best.makespan)


def best_known(graph: OpGraph, machine: Machine, model: PerfModel | None = None, *,
               policies: Sequence[str] | None = None, learned: bool = True, cpsat_s: float = 10.0,
               cpsat_max_ops: int = 200, search_trials: int = 500, local_steps: int = 2000,
               seed: int = 0) -> BestKnown:
    """The fastest plan opsched can find for ``graph`` on ``machine`` under
    ``model`` (see the module docstring).  ``policies``: the heuristics to run
    (default every one of :func:`~opsched.policies.heuristic_names`); ``cpsat_s``,
    ``search_trials``, ``local_steps``: 0 leaves that method out (CP-SAT is
    also left out when OR-Tools is not installed, with ``cpsat_status``
    saying so)."""
    from opsched.engine.bounds import allocation_lp_bound, cpsat_schedule
    from opsched.engine.sim import prepare, replay_plan_makespan
    from opsched.errors import OpschedError
    from opsched.policies import get_policy, heuristic_names

    static = prepare(graph, machine, model)

    def simulate(plan: Plan) -> float:
        return replay_plan_makespan(static, plan)

    plans: dict[str, Plan] = {}
    spans: dict[str, float] = {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    for name in (heuristic_names() if policies is None else policies):
        plan = get_policy(name).plan(graph, machine, model)
        plans[f"heuristic:{name}"], spans[f"heuristic:{name}"] = plan, simulate(plan)
    seconds["heuristics"] = time.perf_counter() - t0
    if learned:
        t0 = time.perf_counter()
        try:
            plan = get_policy("learned").plan(graph, machine, model)
            plans["learned"], spans["learned"] = plan, simulate(plan)
        except OpschedError:  # e.g. a machine the shipped policy was not trained for
            pass
        seconds["learned"] = time.perf_counter() - t0

    def best_so_far() -> str:
        return min(spans, key=spans.__getitem__)

    t0 = time.perf_counter()
    lp = allocation_lp_bound(graph, machine, model)
    seconds["lp"] = time.perf_counter() - t0
    cp_bound, cp_optimal, cp_status = float("nan"), False, "not run"
    if cpsat_s > 0 and len(graph.ops) <= cpsat_max_ops:
        t0 = time.perf_counter()
        try:
            res = cpsat_schedule(graph, machine, model, cpsat_s, hint=plans[best_so_far()], lower_bound=lp,
                                 seed=seed)
            cp_bound, cp_optimal, cp_status = res.lower_bound_s, res.optimal, res.status
            if res.plan is not None:
                plans["cpsat"], spans["cpsat"] = res.plan, res.makespan_s
        except OpschedError as exc:  # OR-Tools missing
            cp_status = f"skipped: {exc}"
        seconds["cpsat"] = time.perf_counter() - t0
    elif cpsat_s > 0:
        cp_status = f"skipped: {len(graph.ops)} ops > cpsat_max_ops={cpsat_max_ops}"
    if search_trials > 0:
        t0 = time.perf_counter()
        plan = get_policy("search", n_trials=search_trials, seed=seed).plan(graph, machine, model)
        plans["search"], spans["search"] = plan, simulate(plan)
        seconds["search"] = time.perf_counter() - t0
    if local_steps > 0:
        t0 = time.perf_counter()
        for start in dict.fromkeys((best_so_far(), *(k for k in ("cpsat", "learned") if k in plans))):
            plan, span = iterated_local_search(graph, machine, model, plans[start], local_steps, seed)
            if math.isfinite(span) and span < spans.get("local-search", math.inf):
                plans["local-search"], spans["local-search"] = plan, simulate(plan)
        seconds["local-search"] = time.perf_counter() - t0
    source = best_so_far()
    bound = max(lp, cp_bound) if math.isfinite(cp_bound) else lp
    best = plans[source]
    best = Plan(best.assignments, best.graph_fingerprint, best.machine_fingerprint, "best-known",
                {**best.meta, "source": source})
    return BestKnown(best, spans[source], source, spans, bound, lp, cp_bound, cp_optimal, cp_status, seconds)


__all__ = ["BestKnown", "best_known", "iterated_local_search", "iterated_slot_search"]
