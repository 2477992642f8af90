"""The heuristics' plans of a (graph, machine), and the best of them: the learned policy's starting point.

The learned policy does not start from nothing: its observation carries the
best heuristic's decision for every op (device, threads, place in the order;
``hint_*`` in :mod:`opsched.engine.layout`), so imitation is reading, and
what training teaches is where to deviate.  At plan time the same plans are
the candidates the policy must beat.  Computed once per (graph, machine,
performance model) and cached: the environment, imitation and the exported
scheduler ask for the same pairs many times.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from opsched.engine.sim import cached_fingerprint
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan

#: The heuristics whose best plan is the policy's hint (and its default plan-time candidates).
HINT_HEURISTICS: tuple[str, ...] = ("sequential", "tf-default", "tf-recommended", "critical-path-first", "heft",
                                    "maestro")

_CACHE: OrderedDict[tuple, dict[str, tuple[Plan, float]]] = OrderedDict()
_CACHE_SIZE = 4096
_LOCK = threading.Lock()


def heuristic_plans(graph: OpGraph, machine: Machine, model: Any = None,
                    names: Sequence[str] = HINT_HEURISTICS) -> dict[str, tuple[Plan, float]]:
    """Each heuristic's Plan and its simulated makespan under ``model``, by name."""
    from opsched.backends.sim import SimBackend
    from opsched.policies import get_policy

    key = (cached_fingerprint(graph), cached_fingerprint(machine), getattr(model, "name", "analytic"),
           id(model) if model is not None else 0, tuple(names))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    sim = SimBackend(machine, model)
    out = {}
    for name in names:
        plan = get_policy(name).plan(graph, machine, model)
        out[name] = (plan, float(sim.run(graph, plan).makespan))
    with _LOCK:
        _CACHE[key] = out
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out


def best_heuristic(graph: OpGraph, machine: Machine, model: Any = None,
                   names: Sequence[str] = HINT_HEURISTICS) -> tuple[str, Plan, float]:
    """(name, Plan, makespan) of the fastest of ``names`` (the first of equals)."""
    plans = heuristic_plans(graph, machine, model, names)
    name = min(plans, key=lambda k: plans[k][1])
    return name, plans[name][0], plans[name][1]


__all__ = ["HINT_HEURISTICS", "best_heuristic", "heuristic_plans"]
