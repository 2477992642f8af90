"""The heuristics' plans of a (graph, machine), and the best of them: the learned policy's starting point.

The learned policy does not start from nothing: its observation carries the
best heuristic's decision for every op (device, threads, place in the order;
``hint_*`` in :mod:`opsched.engine.layout`), so imitation is reading, and
what training teaches is where to deviate.  At plan time the same plans are
the candidates the policy must beat.  The heuristics are those registered
with the ``hint`` role (:func:`hint_names`; recorded in every exported
``policy.json``).  Computed once per (graph, machine, performance model) and
cached: the environment, imitation and the exported scheduler ask for the
same pairs many times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opsched.engine.sim import Simulator, cached_fingerprint
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
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
            out[name] = (plan, sim.makespan(graph, plan, validate=False))  # a policy's plans come validated
        return out

    return _CACHE.get_or_make(key, make, *(() if model is None else (model,)))


def clear_cache() -> None:
    """Forget every heuristic plan computed so far (benchmarks that time
    planning from scratch: the heuristics are part of a first plan's cost)."""
    _CACHE.clear()


def best_heuristic(graph: OpGraph, machine: Machine, model: Any = None,
                   names: Sequence[str] | None = None) -> tuple[str, Plan, float]:
    """(name, Plan, makespan) of the fastest of ``names`` (default: the hint heuristics; the first of equals)."""
    plans = heuristic_plans(graph, machine, model, names)
    name = min(plans, key=lambda k: plans[k][1])
    return name, plans[name][0], plans[name][1]


__all__ = ["best_heuristic", "clear_cache", "heuristic_plans", "hint_names"]
