"""Plans over an episode's op slots: what decoded episodes, heuristics and search share.

A :class:`SlotPlan` is a Plan as the planning engine sees one episode: per op
slot of the (possibly coarsened) graph a device index, a thread-level index,
a rank in the dispatch order and the slots it must wait for.  Decoded
episodes (:func:`from_episode`), heuristics' Plans (:func:`from_plan`) and
search results share it, so they are simulated on the same engine state
(:func:`makespan`), compared like for like, and turned back into a Plan for
the original graph (:func:`to_plan`).

The local search that improves slot plans is :mod:`opsched.policies.refine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.engine.sim import replay_lists
from opsched.errors import ExecutionError
from opsched.plan import Assignment, Plan


@dataclass
class SlotPlan:
    """A plan over an episode's op slots (see the module docstring)."""

    device: list[int]
    level: list[int]
    rank: list[int]                                   # position in the dispatch order (0 first)
    after: list[tuple[int, ...]]
    source: str = ""
    makespan: float = float("inf")                    # simulated on the episode's graph (coarse, if coarsened)
    meta: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> SlotPlan:
        return SlotPlan(list(self.device), list(self.level), list(self.rank), list(self.after), self.source,
                        self.makespan, dict(self.meta))


def from_plan(data: Any, plan: Plan, source: str = "") -> SlotPlan:
    """A Plan for the original graph, projected onto the episode's slots: a
    group takes the assignment of its highest-priority member (the largest
    thread level of its device not above that member's threads); its
    ``after`` slots are the groups its members wait for."""
    graph, machine, co = data.graph, data.machine, data.coarsening
    dev_index = machine.device_index
    ids = [op.id for op in graph.ops]
    index = graph.index
    group_of = co.group_of
    device, level, prio, after = [], [], [], []
    for g, members in enumerate(co.groups):
        lead = max(members, key=lambda i: (plan[ids[i]].priority, -i))
        a = plan[ids[lead]]
        d = dev_index[a.device]
        ok = [k for k, t in enumerate(data.static.levels[d]) if t <= a.threads]
        device.append(d)
        level.append(ok[-1] if ok else 0)
        prio.append(a.priority)
        deps = {int(group_of[index[x]]) for i in members for x in plan[ids[i]].after}
        deps.discard(g)
        after.append(tuple(sorted(deps)))
    order = sorted(range(len(co.groups)), key=lambda g: (-prio[g], g))
    rank = [0] * len(order)
    for r, g in enumerate(order):
        rank[g] = r
    out = SlotPlan(device, level, rank, after, source)
    if not co.identity and any(after) and not np.isfinite(makespan(data, out)):
        # holds between members of two groups in both directions would stall the coarse replay:
        # keep the heuristic's devices, threads and order, drop its holds
        out = SlotPlan(device, level, rank, [()] * len(after), source)
        makespan(data, out)
    return out


def from_episode(ep: Any, source: str = "") -> SlotPlan:
    """A finished engine :class:`~opsched.engine.episode.Episode`'s decisions."""
    data, st = ep.data, ep.st
    n = data.n
    rank = [0] * n
    for k, i in enumerate(ep.order):
        rank[i] = k
    level = [data.static.level_index[st.device[i]][st.threads[i]] for i in range(n)]
    after = [() if ep.after[i] is None else (ep.after[i],) for i in range(n)]
    return SlotPlan(list(st.device), level, rank, after, source, float(st.now))


def _assignments(data: Any, sp: SlotPlan) -> list[Assignment]:
    n = data.n
    ids, dev_ids, levels = data.static.op_ids, data.static.dev_ids, data.static.levels
    return [Assignment(dev_ids[sp.device[i]], int(levels[sp.device[i]][sp.level[i]]), float(n - sp.rank[i]),
                       tuple(ids[j] for j in sp.after[i])) for i in range(n)]


def makespan(data: Any, sp: SlotPlan) -> float:
    """``sp`` replayed in the simulator on the episode's (coarse) graph; also stored in ``sp.makespan``."""
    n = data.n
    levels = data.static.levels
    dev = list(sp.device)
    thr = [int(levels[d][lv]) for d, lv in zip(dev, sp.level, strict=True)]
    prio = [float(n - r) for r in sp.rank]  # the priorities _assignments gives, without building the Plan
    after = [tuple(a) for a in sp.after] if any(sp.after) else None
    try:
        st, _ = replay_lists(data.static, dev, thr, prio, after)
        sp.makespan = float(st.now)
    except ExecutionError:  # a projected plan whose holds cross coarse groups both ways: it would stall
        sp.makespan = float("inf")
    return sp.makespan


def to_plan(data: Any, sp: SlotPlan, policy: str, meta: dict[str, Any] | None = None) -> Plan:
    """``sp`` as a Plan for the original graph (a coarse group's decision expanded to its members)."""
    from opsched.engine.sim import cached_fingerprint, plan_fingerprint

    asg = _assignments(data, sp)
    co = data.coarsening
    assignments = dict(zip(data.static.op_ids, asg, strict=True)) if co.identity else co.expand(asg)
    return Plan(assignments, cached_fingerprint(data.graph), plan_fingerprint(data.machine), policy,
                {"coarsened": not co.identity, **(meta or {})})


def best_of(data: Any, plans: Sequence[SlotPlan]) -> SlotPlan:
    """The fastest of ``plans`` (simulated where not yet), the first of equals."""
    for sp in plans:
        if not np.isfinite(sp.makespan):
            makespan(data, sp)
    return min(plans, key=lambda sp: sp.makespan)


__all__ = ["SlotPlan", "best_of", "from_episode", "from_plan", "makespan", "to_plan"]
