"""A plan replay's makespan in one fused loop: what planners and local search pay for.

Local search, the heuristics' scoring and the exported scheduler's candidates
replay whole plans hundreds of times per planning call and read nothing of
the run but its makespan; those replays were about half of planning a
200-op graph (issue 23's 100 ms target).  :class:`opsched.engine.sim.SimState`
is built for the environment, which starts ops one decision at a time and
reads every field: a replay through it pays a method call per op start,
completion and rate update, and keeps trace, memory and core-slot
bookkeeping that a makespan never reads.

:func:`fast_makespan` runs the same dispatch (``opsched.engine.sim``'s
``_dispatch``: ready ops by rank, per device, at every event) and the same
event loop (``SimState.advance`` / ``_flush``: progress-based durations,
finish times superseded by version, the analytic interference law, GPU
occupancy), fused into one function with everything in locals, and with the
same floating-point operations in the same order, so its makespan equals
the general replay's *exactly* (a hypothesis test compares them bit for bit
on random graphs, machines and plans).  It applies only where the run has
nothing else to price (:func:`supports`): no runtime model (hand-offs,
OpenMP spin and teams, thread switches), the analytic interference law, no
busy cores.  Everything else takes the general path
(:func:`opsched.engine.sim.replay_makespan` decides).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Sequence
from typing import Any

from opsched.errors import ExecutionError


def supports(s: Any) -> bool:
    """Whether :func:`fast_makespan` prices a run on ``s`` (a
    :class:`~opsched.engine.sim.SimStatic`) as the general replay does."""
    return s.runtime is None and s.inline_slowdown and not any(s.busy)


def corun_rates(demands: list[float], total: float, bandwidth: float) -> Sequence[float]:
    """The analytic interference law's rates (1 / slowdown) of ops co-running on a device
    of ``bandwidth`` GB/s with alone demands ``demands`` summing to ``total``
    (``AnalyticModel.slowdown``: ``1 + clip(demand / bw, 0, 1) * (total / bw - 1)``),
    shared by :func:`fast_makespan` and ``SimState._flush``.  Only the rate update
    that follows stays written out in both: as a call per flush it cost the fused
    loop 10-34% of its speed (measured on 25- and 200-op graphs)."""
    if total <= bandwidth or total <= 0:
        return (1.0,) * len(demands)
    over = total / bandwidth - 1.0
    return [1.0 / (1.0 + (x / bandwidth if x < bandwidth else 1.0) * over) if x > 0 else 1.0 for x in demands]


def fast_makespan(s: Any, dev: list[int], thr: list[int], order: list[int], rank: list[int],
                  after: list[tuple[int, ...]] | None, noise: Sequence[float] | None = None) -> float:
    """The makespan of the plan given as per-op devices, threads, dispatch
    ``order`` (op indices, first first) and ``rank`` (its inverse), and the
    ops each waits for (None: none anywhere), on ``s`` (see the module
    docstring; :func:`supports` must hold).  Raises
    :class:`~opsched.errors.ExecutionError` where the general replay stalls."""
    n, n_dev = s.n, s.n_dev
    preds = s.preds
    times, demands, level_index = s.times, s.demands, s.level_index
    edge_bytes, transfer = s.edge_bytes, s.transfer
    bandwidth = s.bandwidth
    occ = s.occupancy
    gpus = s.gpus
    if after is not None and any(after):
        succ = [list(x) for x in s.succs]
        pending = [len(p) for p in preds]
        for i, deps in enumerate(after):
            for j in set(deps).difference(preds[i]):
                if j == i:
                    continue
                succ[j].append(i)
                pending[i] += 1
    else:
        succ = s.succs
        pending = [len(p) for p in preds]
    free = list(s.caps)
    end_time = [0.0] * n
    work = [0.0] * n
    last = [0.0] * n
    rate = [0.0] * n
    ver = [0] * n
    demand = [0.0] * n
    computing: list[list[int]] = [[] for _ in range(n_dev)]
    dirty: set[int] = set()
    heap: list[tuple[float, int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    seq = 0
    now = 0.0
    n_done = 0
    queues: list[list[int]] = [[] for _ in range(n_dev)]
    newly = [i for i in range(n) if pending[i] == 0]
    devices = range(n_dev)

    while True:
        # ---- dispatch (engine.sim._dispatch): ready ops by rank, per device
        if newly:
            for i in newly:
                insort(queues[dev[i]], rank[i])
            newly = []
        for d in devices:
            q = queues[d]
            if not q:
                continue
            f = free[d]
            j = 0
            while f > 0 and j < len(q):
                i = order[q[j]]
                k = thr[i]
                if k > f:
                    j += 1
                    continue
                del q[j]
                f -= k
                # ---- SimState.start_unchecked
                free[d] -= k
                arrive = now
                for p in preds[i]:
                    dp = dev[p]
                    if dp != d:
                        t = end_time[p] + transfer(edge_bytes[(p, i)], dp, d)
                        if t > arrive:
                            arrive = t
                lv = level_index[d].get(k)
                if lv is not None:
                    t_alone, dm = times[i][d][lv], demands[i][d][lv]
                else:
                    t_alone, dm = s.time_and_demand(i, d, k)
                if noise is not None:
                    t_alone *= noise[i]
                work[i] = t_alone
                demand[i] = dm
                if arrive > now:
                    seq += 1
                    push(heap, (arrive, seq, i, -1))
                else:  # SimState._begin
                    last[i] = now
                    rate[i] = 0.0
                    computing[d].append(i)
                    dirty.add(d)
        if n_done == n:
            return now
        # ---- SimState.advance: flush, then complete every op ending at the next event time
        completed = False
        while True:
            if dirty:  # ---- SimState._flush (rates of the devices whose co-runners changed)
                for d in sorted(dirty) if len(dirty) > 1 else dirty:
                    ops = computing[d]
                    if not ops:
                        continue
                    bw = bandwidth[d]
                    if len(ops) == 1:
                        dem = None
                        tot = 0.0
                    else:
                        dem = list(map(demand.__getitem__, ops))
                        tot = sum(dem)  # the general loop's sum, in the same order
                    if dem is None or tot <= bw:
                        if not (occ is not None and gpus[d]):
                            for i in ops:
                                if rate[i] != 1.0:
                                    w = work[i] - (now - last[i]) * rate[i]
                                    if w < 0.0:
                                        w = 0.0
                                    work[i] = w
                                    last[i] = now
                                    rate[i] = 1.0
                                    v = ver[i] + 1
                                    ver[i] = v
                                    seq += 1
                                    push(heap, (now + w, seq, i, v))
                            continue
                        rates: Sequence[float] = (1.0,) * len(ops)
                    else:
                        rates = corun_rates(dem, tot, bw)
                    if occ is not None and gpus[d]:
                        share = sum(occ[i][d] for i in ops)
                        if share > 1.0:
                            cap = 1.0 / share
                            rates = [r if r < cap else cap for r in rates]
                    for i, r in zip(ops, rates, strict=True):
                        r0 = rate[i]
                        if r != r0:
                            w = work[i] - (now - last[i]) * r0
                            if w < 0.0:
                                w = 0.0
                            work[i] = w
                            last[i] = now
                            rate[i] = r
                            v = ver[i] + 1
                            ver[i] = v
                            seq += 1
                            push(heap, (now + w / r, seq, i, v))
                dirty.clear()
            while heap:
                top = heap[0]
                v = top[3]
                if v < 0 or v == ver[top[2]]:
                    break
                pop(heap)  # a finish time superseded by a rate change
            if not heap:
                if completed:
                    break
                raise ExecutionError(f"simulation stalled at t={now:.6g}s: nothing is running and "
                                     f"{n - n_done} op(s) are not done")
            t = heap[0][0]
            if completed and t > now:
                break
            if t > now:
                now = t
            while heap and heap[0][0] <= t:
                _, _, i, v = pop(heap)
                d = dev[i]
                if v == -1:  # SimState._begin: the op's inputs arrived
                    last[i] = now
                    rate[i] = 0.0
                    computing[d].append(i)
                    dirty.add(d)
                elif v == ver[i]:  # SimState._complete
                    end_time[i] = now
                    n_done += 1
                    free[d] += thr[i]
                    computing[d].remove(i)
                    dirty.add(d)
                    for j in succ[i]:
                        pending[j] -= 1
                        if pending[j] == 0:
                            newly.append(j)
                    completed = True


__all__ = ["corun_rates", "fast_makespan", "supports"]
