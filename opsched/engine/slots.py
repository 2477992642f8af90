"""Plans over an episode's op slots: what decoded episodes, heuristics and search share.

A :class:`SlotPlan` is a Plan as the planning engine sees one episode: per op
slot of the (possibly coarsened) graph a device index, a thread-level index,
a rank in the dispatch order and the slots it must wait for.  Decoded
episodes (:func:`from_episode`), heuristics' Plans (:func:`from_plan`) and
search results share it, so they are simulated on the same engine state
(:func:`makespan`), compared like for like, and turned back into a Plan for
the original graph (:func:`to_plan`).

The local search that improves slot plans is :mod:`opsched.policies.refine`.

**Following a plan member by member.**  A slot's decision is one device and
one thread level, so expanding it gives every member of a coarse group the
same assignment, on a level of the grid.  A heuristic's plan need not: CPA
gives each op its own thread count, HEFT leaves cheap members of a GPU
group on the CPU, TensorFlow's settings use counts between levels.  Its
projection therefore loses where the plan itself does not (measured, the
test split's coarsened CPU and training-step pairs, every group taking the
projected decision: 1.332x the best heuristic expanded slot by slot, 1.036x
member by member).  So :func:`to_plan` takes a :class:`Follow` (a plan and
its projection): a slot whose decision *is* the projected one takes the
plan's own device and thread count for each member, while the dispatch
order and the holds stay the slot plan's.  A slot that deviates is expanded
as before.  Taking the hinted action therefore means "do what the hint's
plan does with these ops", which is what a policy trained to follow or
leave the hint decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.engine.sim import replay_slot_makespan
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


@dataclass(frozen=True)
class Follow:
    """A plan for the original graph and its projection onto the episode's slots
    (:func:`from_plan`): what :func:`to_plan` follows member by member where a
    slot plan keeps the projected decision (see the module docstring)."""

    plan: Plan
    slots: SlotPlan


def follow_of(data: Any, plan: Plan, source: str = "") -> Follow:
    """``plan`` with its projection onto ``data``'s slots, to follow in :func:`to_plan`."""
    return Follow(plan, from_plan(data, plan, source))


def from_plan(data: Any, plan: Plan, source: str = "") -> SlotPlan:
    """A Plan for the original graph, projected onto the episode's slots: on a
    coarsened graph the faster, replayed on the slots, of a group taking its
    leading member's device (:func:`_project` with ``by_time=False``) and
    the device where the plan spends most of its time (``by_time=True``);
    each alone loses up to 16x on some training steps and GPU machines
    (measured: an inception step with HEFT's plan on dgx1-4v100 by the
    first, a MobileNetV2 step by the second, 1.8x).

    The projection is cached on ``data`` per plan object (Plans are frozen):
    the observation's hint, the teacher and plan-time refinement project the
    same heuristic plan, and on a coarsened graph each projection costs two
    replays.  Callers get a copy, so they may change it."""
    cache = getattr(data, "projections", None)  # None: episode-like data without a cache (opsched.ceiling)
    hit = cache.get(id(plan)) if cache is not None else None
    if hit is not None and hit[0] is plan:
        out = hit[1].copy()
        out.source = source
        return out
    if data.coarsening.identity:
        best = _project(data, plan, source, by_time=False)
    else:
        first = _project(data, plan, source, by_time=False)
        # where no group has members on two devices, the by-time projection is this one
        second = _project(data, plan, source, by_time=True) if _splits_a_group(data, plan) else first
        for sp in (first, second):
            if not np.isfinite(sp.makespan):
                makespan(data, sp)
        best = second if second.makespan < first.makespan else first
    if cache is not None:
        cache[id(plan)] = (plan, best.copy())  # the plan is kept, so its id is not reused
    return best


def _splits_a_group(data: Any, plan: Plan) -> bool:
    """Whether ``plan`` puts the members of some coarse group on more than one device
    (only then can :func:`_project`'s ``by_time`` choose another device than the leading
    member's, so only then do the two projections differ)."""
    ids = [op.id for op in data.graph.ops]
    for members in data.coarsening.groups:
        if len(members) > 1:
            first = plan[ids[members[0]]].device
            if any(plan[ids[i]].device != first for i in members):
                return True
    return False


def _project(data: Any, plan: Plan, source: str, by_time: bool) -> SlotPlan:
    """One projection of :func:`from_plan`.

    A single-op slot takes its op's assignment (the largest thread level of
    its device not above its threads).  A coarse group takes its leading
    (highest-priority) member's assignment, or with ``by_time`` the device on
    which the plan spends most of the group's time (its members' times at
    their assigned devices and levels), the threads of its highest-priority
    member there, and the priority of its highest-priority member overall
    (the plan's order): a HEFT plan on a GPU machine leaves a few cheap early
    ops on the CPU, and a group led by one of them would drag its
    convolutions there.  Its ``after`` slots are the groups its members wait
    for."""
    graph, machine, co = data.graph, data.machine, data.coarsening
    dev_index = machine.device_index
    ids = [op.id for op in graph.ops]
    index = graph.index
    group_of = co.group_of
    levels = data.static.levels

    def level_of(d: int, threads: int) -> int:
        ok = [k for k, t in enumerate(levels[d]) if t <= threads]
        return ok[-1] if ok else 0

    times = None
    if by_time and not co.identity:
        from opsched.engine.sim import prepare

        times = prepare(graph, machine, data.static.model).table.times  # (ops, devices, levels)
    device, level, prio, after = [], [], [], []
    for g, members in enumerate(co.groups):
        lead = max(members, key=lambda i: (plan[ids[i]].priority, -i))
        a = plan[ids[lead]]
        d = dev_index[a.device]
        if times is not None and len(members) > 1:
            spent: dict[int, float] = {}
            for i in members:
                b = plan[ids[i]]
                di = dev_index[b.device]
                spent[di] = spent.get(di, 0.0) + float(times[i, di, level_of(di, b.threads)])
            d = max(spent, key=lambda x: (spent[x], x == d))  # ties: the leading member's device
            if dev_index[a.device] != d:
                a = plan[ids[max((i for i in members if dev_index[plan[ids[i]].device] == d),
                                 key=lambda i: (plan[ids[i]].priority, -i))]]
        device.append(d)
        level.append(level_of(d, a.threads))
        prio.append(plan[ids[lead]].priority)
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
    try:
        sp.makespan = replay_slot_makespan(data.static, sp.device, sp.level, sp.rank, sp.after)
    except ExecutionError:  # a projected plan whose holds cross coarse groups both ways: it would stall
        sp.makespan = float("inf")
    return sp.makespan


def to_plan(data: Any, sp: SlotPlan, policy: str, meta: dict[str, Any] | None = None,
            follow: Follow | None = None) -> Plan:
    """``sp`` as a Plan for the original graph (a coarse group's decision expanded to
    its members).  With ``follow``, each slot whose (device, thread level) is the
    one ``follow`` projected gives its members ``follow.plan``'s own device and
    thread count (the module docstring); ``meta["followed"]`` counts those slots."""
    from opsched.engine.sim import cached_fingerprint, plan_fingerprint

    asg = _assignments(data, sp)
    co = data.coarsening
    assignments = dict(zip(data.static.op_ids, asg, strict=True)) if co.identity else co.expand(asg)
    extra: dict[str, Any] = {"coarsened": not co.identity}
    if follow is not None:
        extra["followed"] = _follow(data, sp, follow, assignments)
    return Plan(assignments, cached_fingerprint(data.graph), plan_fingerprint(data.machine), policy,
                {**extra, **(meta or {})})


def episode_plan(data: Any, ep: Any, policy: str, meta: dict[str, Any] | None = None) -> Plan:
    """A finished episode's Plan for the original graph, following the hint's plan
    member by member where the episode took the hinted decision
    (``data.hint_follow``, :func:`to_plan`): what the exported scheduler plans and
    training's validation scores.  Without a hint, the episode's own Plan.

    Its dispatch order is the faster, simulated on the original graph, of the
    episode's and the hint plan's (:func:`in_hint_order`; ``meta["order"]``
    says which, the episode's on ties).  On a coarsened graph the episode
    dispatches whole groups, so even an episode that keeps the hinted decision
    in every slot runs the members in the groups' order, not in the plan's
    own, and can lose to the very plan it follows (zoo:nasnet@1 on 2x2080ti,
    HEFT's plan followed in all 128 slots: 1.110x HEFT's makespan); on an
    episode's own graph the policy's order sometimes beats the hint's
    (erdos_renyi:150 on dgx1-4v100, 0.725x).  Chosen on the selection sets
    (``python -m opsched.benchmarks.greedy_order --split
    val|train-coarse``, docs/learning.md): validation 1.0109 -> 1.0109, the training split's
    coarsened graphs 1.0128 -> 1.0090x the best heuristic."""
    if data.hint_follow is None:
        return ep.plan(policy, meta or {})
    followed = to_plan(data, from_episode(ep), policy, meta, follow=data.hint_follow)
    return faster_order(data, followed, data.hint_follow.plan)


def in_hint_order(plan: Plan, hint: Plan) -> Plan:
    """``plan``'s devices and thread counts with ``hint``'s priorities and holds
    (both Plans for the same graph): the hint's dispatch order.  The holds of a
    valid plan stay acyclic with the graph's edges whatever the devices, so the
    result is a valid schedule too."""
    asg = {op: Assignment(a.device, a.threads, hint[op].priority, hint[op].after)
           for op, a in plan.assignments.items()}
    return Plan(asg, plan.graph_fingerprint, plan.machine_fingerprint, plan.policy, {**plan.meta, "order": "hint"})


def faster_order(data: Any, plan: Plan, hint: Plan) -> Plan:
    """The faster on ``data``'s original graph, under its planning model, of ``plan`` in its own
    dispatch order and in ``hint``'s (:func:`in_hint_order`); ties keep ``plan``'s order.
    The result's ``meta["order"]`` is ``"episode"`` or ``"hint"``."""
    from opsched.engine.sim import prepare, replay_plan_makespan

    own = Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint, plan.policy,
               {**plan.meta, "order": "episode"})
    reordered = in_hint_order(plan, hint)
    if reordered.assignments == own.assignments:
        return own
    s = prepare(data.graph, data.machine, data.static.model)
    try:
        faster = replay_plan_makespan(s, reordered) < replay_plan_makespan(s, own)
    except ExecutionError:  # a replay that stalls (it should not: the holds are a valid plan's)
        faster = False
    return reordered if faster else own


def _follow(data: Any, sp: SlotPlan, follow: Follow, assignments: dict[str, Assignment]) -> int:
    """Give the members of every slot that kept ``follow``'s projected decision the
    followed plan's device and threads, in place; returns how many slots did."""
    ref, plan = follow.slots, follow.plan
    if len(ref.device) != len(sp.device):
        raise ValueError(f"to_plan: the followed projection has {len(ref.device)} slots, the slot plan "
                         f"{len(sp.device)}")
    ids = data.static.op_ids if data.coarsening.identity else [op.id for op in data.graph.ops]
    kept = 0
    for g, members in enumerate(data.coarsening.groups):
        if sp.device[g] != ref.device[g] or sp.level[g] != ref.level[g]:
            continue
        kept += 1
        for i in members:
            op = ids[i]
            a, h = assignments[op], plan[op]
            if (a.device, a.threads) != (h.device, h.threads):
                assignments[op] = Assignment(h.device, h.threads, a.priority, a.after)
    return kept


def best_of(data: Any, plans: Sequence[SlotPlan]) -> SlotPlan:
    """The fastest of ``plans`` (simulated where not yet), the first of equals."""
    for sp in plans:
        if not np.isfinite(sp.makespan):
            makespan(data, sp)
    return min(plans, key=lambda sp: sp.makespan)


__all__ = ["Follow", "SlotPlan", "best_of", "episode_plan", "faster_order", "follow_of", "from_episode", "from_plan",
           "in_hint_order", "makespan", "to_plan"]
