"""Local search over slot plans: improve a plan by replaying neighbours in the simulator.

:func:`local_search` is first-improvement hill climbing over three moves -
an op's thread level, an op's device, an op's place in the dispatch order -
each judged by replaying the plan on the episode's engine state
(:func:`opsched.engine.slots.makespan`).  Training uses it to improve the
policy's own plans into its next targets (search distillation,
:mod:`opsched.agents.expert_iteration`); it needs numpy and the engine only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opsched.engine.slots import SlotPlan, makespan


def _move(data: Any, sp: SlotPlan, rng: np.random.Generator) -> SlotPlan | None:
    """One random neighbour of ``sp`` (None when the drawn move changes nothing)."""
    n = data.n
    out = sp.copy()
    i = int(rng.integers(n))
    kind = rng.random()
    n_dev = data.static.n_dev
    if kind < 0.4:  # thread level
        lv = data.static.levels[out.device[i]]
        if len(lv) < 2:
            return None
        step = int(rng.choice((-1, 1))) if rng.random() < 0.7 else int(rng.integers(-len(lv), len(lv)))
        new = min(max(out.level[i] + step, 0), len(lv) - 1)
        if new == out.level[i]:
            return None
        out.level[i] = new
    elif kind < 0.6 and n_dev > 1:  # device
        d = int(rng.integers(n_dev))
        if d == out.device[i]:
            return None
        out.device[i] = d
        out.level[i] = min(out.level[i], len(data.static.levels[d]) - 1)
    else:  # place in the dispatch order: move op i before or after another op
        j = int(rng.integers(n))
        ri, rj = out.rank[i], out.rank[j]
        if ri == rj:
            return None
        lo, hi = min(ri, rj), max(ri, rj)
        shift = 1 if ri > rj else -1
        for k in range(n):
            if lo <= out.rank[k] <= hi and k != i:
                out.rank[k] += shift
        out.rank[i] = rj
        out.after[i] = ()  # a hold made for the old order would keep it back
    return out


def local_search(data: Any, start: SlotPlan, budget: int, rng: np.random.Generator, draws: int = 1) -> SlotPlan:
    """First-improvement hill climbing from ``start`` with ``budget`` steps.

    ``draws``: how many random moves a step may draw until one changes the
    plan (a move that changes nothing costs no simulation: a thread-level
    move of an op with one level, a device move to its own device).  1 (the
    training teacher's setting) lets such a draw use up its step; the
    exported scheduler's refine draws up to 8, so each of its steps is a
    simulation, which is what its planning time pays for."""
    best = start.copy()
    if not np.isfinite(best.makespan):
        makespan(data, best)
    for _ in range(max(0, int(budget))):
        cand = None
        for _ in range(max(1, int(draws))):
            cand = _move(data, best, rng)
            if cand is not None:
                break
        if cand is None:
            continue
        if makespan(data, cand) < best.makespan * (1.0 - 1e-9):
            cand.source = f"search({start.source})" if not best.source.startswith("search") else best.source
            best = cand
    return best




def iterated_slot_search(data: Any, start: SlotPlan, steps: int, rng: np.random.Generator,
                         restarts: int = 4, kick: int = 6) -> SlotPlan:
    """A :class:`~opsched.engine.slots.SlotPlan` improved by ``steps`` simulations
    of local search on the episode's slots (``data``): a first climb, then
    ``restarts`` climbs from the best plan with ``kick`` random moves applied
    (taken whatever they cost), each with an equal share.  The training
    teacher (:mod:`opsched.agents.teachers`) searches coarsened episodes with it;
    :func:`opsched.ceiling.iterated_local_search` whole graphs."""
    best = start.copy()
    if not np.isfinite(makespan(data, best)):
        return best
    share = max(1, steps // (restarts + 1))
    best = local_search(data, best, share, rng)
    for _ in range(restarts):
        cand = best.copy()
        for _ in range(kick):
            moved = _move(data, cand, rng)
            if moved is not None:
                cand = moved
        makespan(data, cand)
        cand = local_search(data, cand, share, rng)
        if cand.makespan < best.makespan * (1.0 - 1e-12):
            best = cand
    return best


__all__ = ["iterated_slot_search", "local_search"]
