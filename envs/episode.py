"""One scheduling episode's decision loop, without gymnasium.

:class:`~opsched.envs.schedule_env.ScheduleEnv` (training) and the exported
numpy scheduler (:mod:`opsched.policies.exported`, planning) take the same
decisions on the same state and must record them as the same Plan; both
drive an :class:`Episode`, so there is one implementation of the rules:

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

from typing import Any

from opsched.backends.sim import SimState, cached_fingerprint
from opsched.envs.features import EpisodeData, Observer
from opsched.plan import Assignment, Plan


class Episode:
    """The simulator state, the observation builder and the decisions so far."""

    def __init__(self, data: EpisodeData, noise: list[float] | None = None) -> None:
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

    def can_start_any(self) -> bool:
        st = self.st
        return st.n_ready > 0 and max(st.free) > 0

    def start(self, slot: int, device: int, threads: int) -> None:
        """Start op ``slot`` now (the caller has checked the action is valid)."""
        st = self.st
        if st.now > st.ready_time[slot]:
            self.after[slot] = self.last_completed  # it waited: hold it until this completion on replay
        st._start(slot, device, threads)
        self.obs.started(slot, device, threads)
        self.order.append(slot)

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
        return Plan(assignments, cached_fingerprint(data.graph), cached_fingerprint(data.machine), policy,
                    {"coarsened": not co.identity, **meta})


__all__ = ["Episode"]
