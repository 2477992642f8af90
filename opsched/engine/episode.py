"""One scheduling episode's decision loop: the rules every decision-maker plays by.

The Gymnasium environment (``opsched.envs``, training), the exported numpy
scheduler (``opsched.policies.exported``, planning) and imitation
(``opsched.agents.imitation``, labelling states) take the same decisions on
the same state and must record them as the same Plan; all of them drive an
:class:`Episode`, so the rules are written once:

* *start* (slot, device, threads): the op starts now on the simulator; if it
  became ready before now, it waited for a completion, and the Plan holds it
  (``after``) until the op whose completion let it start -- so replaying the
  Plan reproduces the episode's order;
* *wait*: time advances to the next completion;
* after either, time also advances while nothing can start (no ready op or
  no free slot), so every decision offers a real choice.

The Plan's priorities are the dispatch order (the first op started gets the
highest), and a coarsened graph's decisions are expanded to its ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opsched.engine.layout import MAX_LEVELS, PER_SLOT
from opsched.engine.observe import EpisodeData, Observer
from opsched.engine.sim import SimState, cached_fingerprint, plan_fingerprint
from opsched.plan import Assignment, Plan

#: A chooser sees the episode and its valid actions in factored form (ready op
#: slots, fitting (device, level) columns, whether "wait" is valid) and returns
#: an index into ``ops x cols`` (row-major), or ``len(ops) * len(cols)`` for wait.
Chooser = Callable[["Episode", np.ndarray, np.ndarray, bool], int]


class Episode:
    """The simulator state, the observation builder and the decisions so far."""

    def __init__(self, data: EpisodeData, noise: Sequence[float] | None = None) -> None:
        self.data = data
        self.st = SimState(data.static, noise=noise)
        self.obs = Observer(data, self.st)
        self.st.newly_ready.clear()
        self.order: list[int] = []
        self.after: list[int | None] = [None] * data.n
        self.last_completed: int | None = None

    @property
    def done(self) -> bool:
        return self.st.done

    @property
    def now(self) -> float:
        """Simulated seconds since the episode began."""
        return self.st.now

    @property
    def status(self) -> list[int]:
        """Per op slot: ``engine.sim`` WAITING, READY, RUNNING or DONE (read only)."""
        return self.st.status

    def ready_ops(self) -> list[int]:
        """The ready op slots, ascending."""
        return self.st.ready_ops()

    def can_start_any(self) -> bool:
        st = self.st
        return st.n_ready > 0 and max(st.free) > 0

    def start(self, slot: int, device: int, threads: int) -> None:
        """Start op ``slot`` now (the caller has checked the action is valid)."""
        st = self.st
        if st.now > st.ready_time[slot]:
            self.after[slot] = self.last_completed  # it waited: hold it until this completion on replay
        st.start_unchecked(slot, device, threads)
        self.obs.started(slot, device, threads)
        self.order.append(slot)

    def act(self, action: int, wait: int) -> None:
        """Take flat action ``action`` (``wait`` is the layout's wait index), then settle."""
        if action == wait:
            self.advance()
        else:
            slot, rest = divmod(action, PER_SLOT)
            d, lv = divmod(rest, MAX_LEVELS)
            self.start(slot, d, int(self.data.static.levels[d][lv]))
        self.settle()

    def advance(self) -> None:
        """Advance time to the next completion and update the observation."""
        st = self.st
        completed = st.advance()
        self.last_completed = min(completed)
        self.obs.completed(completed)
        self.obs.ready(st.newly_ready)
        st.newly_ready.clear()

    def settle(self) -> None:
        """Advance while nothing can start: the next decision is a real choice."""
        while not self.st.done and not self.can_start_any():
            self.advance()

    def plan(self, policy: str, meta: dict[str, Any]) -> Plan:
        """The decisions as a Plan for the original graph (valid by construction)."""
        data, st = self.data, self.st
        n = data.n
        ids, dev_ids = data.static.op_ids, data.static.dev_ids
        asg: list[Assignment] = [Assignment()] * n
        for k, i in enumerate(self.order):
            dep = self.after[i]
            asg[i] = Assignment(dev_ids[st.device[i]], st.threads[i], float(n - k),
                                () if dep is None else (ids[dep],))
        co = data.coarsening
        assignments = dict(zip(ids, asg, strict=True)) if co.identity else co.expand(asg)
        return Plan(assignments, cached_fingerprint(data.graph), plan_fingerprint(data.machine), policy,
                    {"coarsened": not co.identity, **meta})


def run_episode(data: EpisodeData, choose: Chooser, noise: Sequence[float] | None = None) -> tuple[Episode, int, int]:
    """Play one episode to the end, asking ``choose`` at every decision with
    more than one valid action; returns the episode, the decisions taken and
    how many of them were forced (one valid action)."""
    ep = Episode(data, noise)
    ep.settle()
    wait = data.max_nodes * PER_SLOT
    obs = ep.obs
    decisions = forced = 0
    while not ep.done:
        ops, cols, can_wait = obs.choices()  # the valid actions: ops x cols, then "wait"
        starts = len(ops) * len(cols)
        if starts + can_wait == 1:
            j = 0
            forced += 1
        else:
            j = choose(ep, ops, cols, can_wait)
        a = wait if j == starts else int(ops[j // len(cols)]) * PER_SLOT + int(cols[j % len(cols)])
        decisions += 1
        ep.act(a, wait)
    return ep, decisions, forced


__all__ = ["Chooser", "Episode", "run_episode"]
