"""The heuristics' plans of a (graph, machine), and the best of them: the learned policy's starting point.

The learned policy does not start from nothing: its observation carries the
best heuristic's decision for every op (device, threads, place in the order;
``hint_*`` in :mod:`opsched.engine.layout`), so imitation is reading, and
what training teaches is where to deviate.  At plan time the same plans are
the candidates the policy must beat.  Which plan is the hint:
:func:`slot_hint`, the fastest as the episode's slots run it (on a coarsened
graph, not always the fastest plan).  The heuristics are those registered
with the ``hint`` role (:func:`hint_names`; recorded in every exported
``policy.json``) and, for a policy exported with ``hint_budget`` (every one
since issue 23's budget hint), those the default search adds for the graph
anyway (:func:`episode_heuristics`): LP rounding on a small graph, LP
rounding and biCPA on a coarsened one and biCPA and LP rounding on a large
one without GPUs, where each is often the best plan
and the greedy decoding, which keeps its hint, lost to them (up to 1.37x on
the test split).  Computed once per (graph, machine, performance model) and
cached: the environment, imitation and the exported scheduler ask for the
same pairs many times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opsched.engine.sim import Simulator, cached_fingerprint
from opsched.errors import ExecutionError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.policies.base import makespan_of
from opsched.policies.registry import HINT, names

_CACHE = IdentityLRU(4096)


def hint_names() -> tuple[str, ...]:
    """The heuristics whose best plan is the policy's hint (and its default plan-time candidates)."""
    return names(HINT)


def heuristic_plans(graph: OpGraph, machine: Machine, model: Any = None,
                    names: Sequence[str] | None = None) -> dict[str, tuple[Plan, float]]:
    """Each heuristic's Plan and its simulated makespan under ``model``, by name
    (default: the hint heuristics)."""
    from opsched.policies.registry import entry

    chosen = tuple(hint_names() if names is None else names)
    key = (cached_fingerprint(graph), cached_fingerprint(machine), getattr(model, "name", "analytic"),
           id(model) if model is not None else 0, chosen)

    def make() -> dict[str, tuple[Plan, float]]:
        sim = Simulator(machine, model)
        out = {}
        for name in chosen:
            plan = entry(name).make().plan(graph, machine, model)
            out[name] = (plan, makespan_of(sim, graph, plan, validate=False))  # a policy's plans come validated
        return out

    return _CACHE.get_or_make(key, make, *(() if model is None else (model,)))


def episode_heuristics(graph: OpGraph, machine: Machine, model: Any, hints: Sequence[str], max_nodes: int,
                       budget: bool = True) -> dict[str, tuple[Plan, float]]:
    """The plans an episode's hint is chosen from (:func:`slot_hint`): ``hints``' plans
    (:func:`heuristic_plans`), and with ``budget`` those of
    :func:`opsched.policies.budget.hint_extra` for this graph and machine after them
    (ties then keep the hint heuristics').  An extra heuristic that fails on the graph
    (:class:`~opsched.errors.OpschedError`) is left out, as the default search leaves
    it out of its candidates.  Training's environment and the exported scheduler both
    call this, so both see the same hint."""
    from opsched.errors import OpschedError
    from opsched.policies.budget import hint_extra

    plans = HintPlans(heuristic_plans(graph, machine, model, hints))
    if budget:
        for name in hint_extra(len(graph.ops), max_nodes, bool(machine.gpus)):
            if name in plans:
                continue
            try:
                plans.update(heuristic_plans(graph, machine, model, (name,)))
            except OpschedError:
                continue
            plans.extra = (*plans.extra, name)
    return plans


class HintPlans(dict):
    """:func:`episode_heuristics`' plans by name, and which of them (``extra``) the
    budget added after the hint heuristics: :func:`slot_hint` projects each of those
    outside its bounded search (see there)."""

    extra: tuple[str, ...] = ()


#: Whether :func:`slot_hint` keeps the budget's extra plans out of its bounded search (see there).
EXTRAS_APART = True


def slot_hint(data: Any, plans: Mapping[str, tuple[Plan, float]], model: Any = None) -> tuple[str, Plan]:
    """(name, Plan) of the heuristic plan that is fastest *as the episode runs it*: the hint.

    On a graph the policy does not coarsen that is the fastest plan.  On a
    coarsened one (more ops than ``max_nodes``) the policy decides per group,
    so what its greedy decoding can follow is the plan projected onto the
    groups (:func:`opsched.engine.slots.from_plan`) and expanded back, member
    by member where a group keeps the projected decision
    (:class:`opsched.engine.slots.Follow`).  Expanded group by group, a
    moldable plan (CPA's: every op its own thread count) lost most there
    (measured: CPA's plan of an inception training step on knl-68, 1.10x the
    best heuristic, replayed at 5.5x; member by member at 1.10x).  The order
    stays the groups', which can still cost a few percent (nasnet's training
    step on 2x2080ti: HEFT's plan 1.053x, followed on the groups 1.080x).
    So each plan's projection is expanded, following the plan, and simulated
    on ``data.graph``, fastest plans first, stopping at the first plan whose
    own makespan is no faster than the best projection so far (a projection
    seldom beats its plan: the bound costs 1-3 simulations instead of one per
    heuristic).
    The plans the planning budget added (``plans.extra``, :class:`HintPlans`)
    stay out of that bounded search and are each projected after it: LP
    rounding's plan of a coarsened CPU graph is often the fastest and projects
    to itself, and as the first plan it ended the search before a slower plan
    whose projection beats every plan (TensorFlow's recommended settings on
    layered graphs: a projection 22% faster than its own plan), so an extra
    replaces the hint heuristics' best only where its projection is faster
    (:data:`EXTRAS_APART`; docs/learning.md).
    Ties keep ``plans``' order, the registry's.  ``plans``: name -> (Plan,
    makespan on ``data.graph`` under ``model``), :func:`heuristic_plans`."""
    if not plans:
        raise ValueError("slot_hint: no heuristic plan to choose the hint from")
    ranked = sorted(plans, key=lambda k: plans[k][1])  # stable: the first of equals
    if data.coarsening.identity:
        return ranked[0], plans[ranked[0]][0]
    from opsched.engine.slots import follow_of, to_plan

    sim = Simulator(data.machine, model)

    def projected(name: str) -> float:
        follow = follow_of(data, plans[name][0], name)
        expanded = to_plan(data, follow.slots, name, follow=follow)
        try:
            return sim.makespan(data.graph, expanded, validate=False)
        except ExecutionError:  # a projection that cannot run (holds across groups): not a hint
            return math.inf

    extra = set(getattr(plans, "extra", ())) if EXTRAS_APART else set()
    bounded = [k for k in ranked if k not in extra] or ranked
    best, best_span = bounded[0], math.inf
    for name in bounded:
        if plans[name][1] >= best_span:
            break
        span = projected(name)
        if span < best_span:
            best, best_span = name, span
    for name in ranked:
        if name in extra and name not in bounded and plans[name][1] < best_span:
            span = projected(name)
            if span < best_span:
                best, best_span = name, span
    return best, plans[best][0]


def attach_slot_hint(data: Any, plans: Mapping[str, tuple[Plan, float]], model: Any = None) -> str:
    """Read the episode's hint (:func:`slot_hint` of ``plans``) into ``data``'s ``hint_*``
    columns (:func:`opsched.engine.observe.attach_hint`) and return its name.  The one
    place an episode gets its hint: training's environment and the exported scheduler
    both call it, so they see the same observation."""
    from opsched.engine.observe import attach_hint

    name, plan = slot_hint(data, plans, model)
    attach_hint(data, plan)
    return name


def clear_cache() -> None:
    """Forget every heuristic plan computed so far, HEFT's cached plans and the GPU
    placements the moldable heuristics share included (benchmarks that time planning
    from scratch: the heuristics are part of a first plan's cost)."""
    from opsched.policies.heft import clear_plans
    from opsched.policies.moldable import clear_placements

    _CACHE.clear()
    clear_plans()
    clear_placements()


def best_heuristic(graph: OpGraph, machine: Machine, model: Any = None,
                   names: Sequence[str] | None = None) -> tuple[str, Plan, float]:
    """(name, Plan, makespan) of the fastest of ``names`` (default: the hint heuristics; the first of equals)."""
    plans = heuristic_plans(graph, machine, model, names)
    name = min(plans, key=lambda k: plans[k][1])
    return name, plans[name][0], plans[name][1]


__all__ = ["EXTRAS_APART", "HintPlans", "attach_slot_hint", "best_heuristic", "clear_cache", "episode_heuristics", "heuristic_plans", "hint_names", "slot_hint"]
