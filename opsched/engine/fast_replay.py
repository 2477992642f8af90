"""A plan replay's makespan in one compiled loop: what planners and local search pay for.

Local search, the heuristics' scoring and the exported scheduler's candidates
replay whole plans hundreds of times per planning call and read nothing of
the run but its makespan.  :class:`opsched.engine.sim.SimState` is built for
the environment, which starts ops one decision at a time and reads every
field: a replay through it pays a method call per op start, completion and
rate update, and keeps trace, memory and core-slot bookkeeping that a
makespan never reads.

:func:`fast_makespan` runs the same dispatch (``opsched.engine.sim``'s
``_dispatch``: ready ops by rank, per device, at every event) and the same
event loop (``SimState.advance`` / ``_flush``: progress-based durations,
finish times superseded by version, the analytic interference law, GPU
occupancy) in one function, :func:`_loop`, over numpy arrays, with the same
floating-point operations in the same order, so its makespan equals the
general replay's *exactly* (a hypothesis test compares them bit for bit on
random graphs, machines and plans, compiled and not).  It applies only where
the run has nothing else to price (:func:`supports`): no runtime model
(hand-offs, OpenMP spin and teams, thread switches) and the analytic
interference law.  Everything else takes the general path
(:func:`opsched.engine.sim.replay_makespan` decides).  Busy cores
(``Device.busy_cores``: ``SimState._busy_share``) are priced here too, since
issue 23's busy-cores family: before, a local-search step there took the
general replay, 0.8 ms on a 100-op graph instead of 50 us.

**One call per replay.**  The plan's own arrays (alone times, the transfer
times of its cross-device edges, its holds merged into the successor lists
by :func:`_merge_holds`, compiled too) are made by whole-array numpy
operations, and a slot plan (:func:`fast_slot_makespan`) is read as it is,
without building per-op Python lists first, and the merged holds are kept
per hold set (:data:`HOLD_CACHE`; local search changes them rarely): a
local-search step on an 80-op graph went from 89 to 33 us (min of 7 runs of
500 steps; the compiled loop itself takes about 11 us of it), which is what
lets the planning budget buy more steps
(:data:`opsched.policies.budget.STEP_COST`, docs/learning.md).

**Compiled with numba** (a dependency; the exported scheduler's numpy-only
contract is unchanged: without numba, or with ``OPSCHED_NO_JIT=1``,
:func:`available` is false and :func:`opsched.engine.sim.replay_makespan`
takes the general replay, since this loop run as Python is 1.3-1.9x slower
than that, measured).  Compiled, a 200-op replay takes 80-150 us instead of
1.5-1.8 ms.  The first call in a process compiles it (about 2.5 s) or loads
it from numba's cache (about 0.4 s with numba's import), which lives in
opsched's cache directory (``<cache>/numba``, :mod:`opsched.cache`) rather
than next to the source; numba's own ``NUMBA_CACHE_DIR`` wins where it is
set.  The
arrays the loop needs of a (graph, machine, model) are built once and kept on
its :class:`~opsched.engine.sim.SimStatic` (:func:`_static_arrays`); per
replay only the plan's own arrays are made (its alone times, transfer
times of its cross-device edges, its holds).
"""

from __future__ import annotations

import functools
import heapq
import math
import os
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import numpy as np

from opsched.errors import ExecutionError

#: Set (to anything but "" or "0") to run the loop as Python: for debugging, and what the tests compare.
NO_JIT_ENV = "OPSCHED_NO_JIT"


def supports(s: Any) -> bool:
    """Whether :func:`fast_makespan` prices a run on ``s`` (a
    :class:`~opsched.engine.sim.SimStatic`) as the general replay does."""
    return s.runtime is None and s.inline_slowdown


def corun_rates(demands: list[float], total: float, bandwidth: float) -> Sequence[float]:
    """The analytic interference law's rates (1 / slowdown) of ops co-running on a device
    of ``bandwidth`` GB/s with alone demands ``demands`` summing to ``total``
    (``AnalyticModel.slowdown``: ``1 + clip(demand / bw, 0, 1) * (total / bw - 1)``),
    as ``SimState._flush`` computes them; :func:`_loop` computes the same floats
    op by op (the bit-for-bit test holds the two together)."""
    if total <= bandwidth or total <= 0:
        return (1.0,) * len(demands)
    over = total / bandwidth - 1.0
    return [1.0 / (1.0 + (x / bandwidth if x < bandwidth else 1.0) * over) if x > 0 else 1.0 for x in demands]


class _Arrays:
    """What :func:`_loop` needs of one (graph, machine, model), as arrays: the
    predecessor and successor lists (CSR, in ``pred_index`` / ``succ_index``
    order), each predecessor edge's bytes, the time and demand tables, a
    (device, threads) -> level lookup (-1: between the levels) and the
    devices' caps, bandwidths and GPU occupancies."""

    def __init__(self, s: Any) -> None:
        n, n_dev = s.n, s.n_dev
        counts = [len(p) for p in s.preds]
        self.pptr = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=self.pptr[1:])
        self.pidx_list = [p for ps in s.preds for p in ps]
        self.pcons_list = [i for i, ps in enumerate(s.preds) for _ in ps]
        self.pbytes = [s.edge_bytes[(p, i)] for i, ps in enumerate(s.preds) for p in ps]
        self.pidx = np.array(self.pidx_list, np.int64)
        self.pcons = np.array(self.pcons_list, np.int64)
        self.indeg = np.array(counts, np.int64)
        self.sptr = np.zeros(n + 1, np.int64)
        np.cumsum([len(x) for x in s.succs], out=self.sptr[1:])
        self.sidx = np.array([j for js in s.succs for j in js], np.int64)
        self.times = np.asarray(s.table.times, np.float64).reshape(n, n_dev, -1)
        self.demands = np.array(s.demands, np.float64).reshape(self.times.shape)
        width = max(s.caps) + 1 if n_dev else 1
        self.lut = np.full((n_dev, width), -1, np.int64)
        for d, index in enumerate(s.level_index):
            for k, lv in index.items():
                if 0 <= k < width:
                    self.lut[d, k] = lv
        self.caps = np.array(s.caps, np.int64)
        self.bandwidth = np.array(s.bandwidth, np.float64)
        self.gpu_occ = np.array([s.occupancy is not None and g for g in s.gpus], np.bool_)
        self.occ = (np.array(s.occupancy, np.float64).reshape(n, n_dev) if s.occupancy is not None
                    else np.zeros((n, n_dev), np.float64))
        self.empty = np.zeros(0, np.int64)
        self.no_xt = np.zeros(len(self.pidx))
        # thread count of each (device, level index), for slot plans (opsched.engine.slots)
        self.level_threads = np.zeros((n_dev, max((len(x) for x in s.levels), default=1)), np.int64)
        for d, lv in enumerate(s.levels):
            self.level_threads[d, :len(lv)] = lv
        self.arange = np.arange(n, dtype=np.int64)
        self.times_flat = self.times.ravel()
        self.demands_flat = self.demands.ravel()
        self.row = self.arange * (n_dev * self.times.shape[2])  # op i's first entry in the flat tables
        self.holds: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.busy = np.array(s.busy, np.float64)
        self.parallel = np.array(s.parallel, np.bool_)
        # transfer seconds per predecessor edge and (source, destination) device, filled on first use
        # (NaN: not asked yet): the model's transfer_time is called once per edge and device pair
        self.xfer = np.full((len(self.pidx), n_dev, n_dev), np.nan) if n_dev > 1 else None


def _static_arrays(s: Any) -> _Arrays:
    """``s``'s :class:`_Arrays`, built on first use and kept on ``s``."""
    a = s.__dict__.get("_fast_arrays")
    if a is None:
        a = s._fast_arrays = _Arrays(s)
    return a


def fast_makespan(s: Any, dev: list[int], thr: list[int], prio: Sequence[float],
                  after: list[tuple[int, ...]] | None, noise: Sequence[float] | None = None,
                  jit: bool = True) -> float:
    """The makespan of the plan given as per-op devices, threads, priorities
    (dispatch order: descending, ties in graph order) and the ops each waits
    for (None: none anywhere), on ``s`` (see the module docstring;
    :func:`supports` must hold); ``jit=False`` runs the loop as Python (what
    the tests compare; :func:`available` must hold otherwise).
    Raises :class:`~opsched.errors.ExecutionError` where the general replay stalls."""
    a = _static_arrays(s)
    if s.n == 0:
        return 0.0
    dv = np.asarray(dev, np.int64)
    th = np.asarray(thr, np.int64)
    # alone times and demands: the table where the count is a level, the model between levels
    width = a.lut.shape[1]
    lv = a.lut[dv, np.minimum(th, width - 1)]
    lv[th >= width] = -1
    work, demand = _alone(a, dv, np.maximum(lv, 0))
    if (lv < 0).any():
        for i in np.flatnonzero(lv < 0).tolist():
            work[i], demand[i] = s.time_and_demand(i, int(dv[i]), int(th[i]))
    if noise is not None:
        work *= np.asarray(noise, np.float64)
    return _run(s, a, dv, th, np.asarray(prio, np.float64), work, demand, after, jit)


def fast_slot_makespan(s: Any, device: Sequence[int], level: Sequence[int], rank: Sequence[int],
                       after: Sequence[tuple[int, ...]]) -> float:
    """:func:`fast_makespan` of a slot plan (:class:`opsched.engine.slots.SlotPlan`'s
    device and thread-level indices, ranks and holds), read as it is: a slot's
    level index is its row of the time table, and its priority ``n - rank``."""
    a = _static_arrays(s)
    if s.n == 0:
        return 0.0
    dv = np.asarray(device, np.int64)
    lv = np.asarray(level, np.int64)
    work, demand = _alone(a, dv, lv)
    return _run(s, a, dv, a.level_threads[dv, lv], float(s.n) - np.asarray(rank, np.float64), work, demand,
                after, True)


def _alone(a: _Arrays, dv: np.ndarray, lv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each op's alone seconds and demand on its device at its table level (fresh arrays)."""
    flat = a.row + dv * a.times.shape[2] + lv
    return a.times_flat.take(flat), a.demands_flat.take(flat)


#: Distinct hold sets whose merged successor lists a static keeps (local search changes them rarely).
HOLD_CACHE = 32


def _run(s: Any, a: _Arrays, dv: np.ndarray, th: np.ndarray, prio: np.ndarray, work: np.ndarray,
         demand: np.ndarray, after: Sequence[tuple[int, ...]] | None, jit: bool) -> float:
    """The loop on one plan's arrays: its dispatch order, cross-device transfer times and holds."""
    n = s.n
    order = np.argsort(-prio, kind="stable")  # ties keep graph order, as _order's sort
    rank = np.empty(n, np.int64)
    rank[order] = a.arange
    # transfer seconds of the edges between two devices (the others are never read)
    xt = a.no_xt
    if a.xfer is not None and len(a.pidx):
        src, dst = dv[a.pidx], dv[a.pcons]
        cross = np.flatnonzero(src != dst)
        if len(cross):
            cs, cd = src[cross], dst[cross]
            got = a.xfer[cross, cs, cd]
            miss = np.isnan(got)
            if miss.any():
                transfer, pb = s.transfer, a.pbytes
                for k in np.flatnonzero(miss).tolist():
                    e = int(cross[k])
                    got[k] = a.xfer[e, cs[k], cd[k]] = transfer(pb[e], int(cs[k]), int(cd[k]))
            xt = np.zeros(len(a.pidx))
            xt[cross] = got
    loop = _compiled() if jit else _loop
    assert loop is not None, "fast_makespan(jit=True) needs numba (see available())"
    sptr, sidx, pending = a.sptr, a.sidx, a.indeg
    if after is not None and any(after):  # holds: one more successor edge j -> i per op i waits for
        sptr, sidx, pending = _holds(a, after, jit)
    now, left = loop(n, s.n_dev, a.pptr, a.pidx, xt, sptr, sidx, pending.copy(), dv, th,
                     order, rank, work, demand, a.caps, a.bandwidth, a.gpu_occ, a.occ, a.busy, a.parallel)
    if left:
        raise ExecutionError(f"simulation stalled at t={float(now):.6g}s: nothing is running and "
                             f"{int(left)} op(s) are not done")
    return float(now)


def _holds(a: _Arrays, after: Sequence[tuple[int, ...]], jit: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The successor lists and pending counts with ``after``'s holds merged in
    (:func:`_merge_holds`), kept for the last :data:`HOLD_CACHE` hold sets."""
    key: Any = None
    hit = None
    if jit:  # run as Python (the tests' reference), the merge always runs
        try:
            key = tuple(after)
            hit = a.holds.get(key)
        except TypeError:  # holds given as lists: not hashable, merged every time
            key = None
    if hit is not None:
        return hit
    merge = _compiled_merge() if jit else _merge_holds
    assert merge is not None
    hsrc = np.fromiter(chain.from_iterable(after), np.int64)
    hdst = np.repeat(a.arange, list(map(len, after)))
    out = merge(len(a.indeg), a.sptr, a.sidx, a.pptr, a.pidx, a.indeg, hsrc, hdst)
    if key is not None:
        if len(a.holds) >= HOLD_CACHE:
            a.holds.clear()
        a.holds[key] = out
    return out


def _merge_holds(n: int, sptr: np.ndarray, sidx: np.ndarray, pptr: np.ndarray, pidx: np.ndarray,
                 indeg: np.ndarray, hsrc: np.ndarray, hdst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The successor lists (CSR) and pending counts with the holds ``hsrc[h] -> hdst[h]``
    (grouped by ``hdst``, ascending) added as edges: a hold on an op itself, on one
    of its predecessors or repeated adds nothing, as ``_dispatch`` reads them
    (numba-compilable).  The order within a successor list is free: ready ops
    queue by rank."""
    pending = indeg.copy()
    keep = np.zeros(len(hsrc), np.bool_)
    extra = np.zeros(n, np.int64)
    for h in range(len(hsrc)):
        j = hsrc[h]
        i = hdst[h]
        if j == i:
            continue
        dup = False
        for e in range(pptr[i], pptr[i + 1]):
            if pidx[e] == j:
                dup = True
                break
        g = h - 1
        while not dup and g >= 0 and hdst[g] == i:
            if hsrc[g] == j:  # an earlier copy of this hold, kept (a predecessor's was skipped above)
                dup = True
            g -= 1
        if dup:
            continue
        keep[h] = True
        extra[j] += 1
        pending[i] += 1
    ptr = np.zeros(n + 1, np.int64)
    for j in range(n):
        ptr[j + 1] = ptr[j] + (sptr[j + 1] - sptr[j]) + extra[j]
    idx = np.empty(ptr[n], np.int64)
    fill = np.zeros(n, np.int64)
    for j in range(n):
        for e in range(sptr[j], sptr[j + 1]):
            idx[ptr[j] + fill[j]] = sidx[e]
            fill[j] += 1
    for h in range(len(hsrc)):
        if keep[h]:
            j = hsrc[h]
            idx[ptr[j] + fill[j]] = hdst[h]
            fill[j] += 1
    return ptr, idx, pending


def _loop(n: int, n_dev: int, pptr: np.ndarray, pidx: np.ndarray, xt: np.ndarray, sptr: np.ndarray,
          sidx: np.ndarray, pending: np.ndarray, dev: np.ndarray,
          thr: np.ndarray, order: np.ndarray, rank: np.ndarray, work: np.ndarray, demand: np.ndarray,
          caps: np.ndarray, bandwidth: np.ndarray, gpu_occ: np.ndarray, occ: np.ndarray, busy: np.ndarray,
          parallel: np.ndarray) -> tuple[float, int]:
    """The dispatch and event loop (numba-compilable: arrays, scalars and one
    heap).  Returns (makespan, 0), or (the time, ops not done) where the run
    stalls.  ``pending`` and ``work`` are consumed.  Mirrors, step by step,
    ``engine.sim._dispatch``, ``SimState.start_unchecked``, ``_begin``,
    ``advance``, ``_flush`` (with ``_busy_share``) and ``_complete``; keep them
    in step (the bit-for-bit test fails on any drift)."""
    free = caps.copy()
    end_time = np.zeros(n)
    last = np.zeros(n)
    rate = np.zeros(n)
    ver = np.zeros(n, np.int64)
    queue = np.empty((n_dev, n), np.int64)  # per device: ranks of the ready ops, ascending
    qlen = np.zeros(n_dev, np.int64)
    computing = np.empty((n_dev, n), np.int64)  # per device: its computing ops, in the order they began
    clen = np.zeros(n_dev, np.int64)
    dirty = np.zeros(n_dev, np.bool_)
    n_dirty = 0
    rates = np.empty(n)
    newly = np.empty(n, np.int64)
    n_new = 0
    for i in range(n):
        if pending[i] == 0:
            newly[n_new] = i
            n_new += 1
    heap: list[Any] = [(0.0, 0, 0, 0)]  # (time, push sequence, op, version; -1: the op's inputs arrive)
    heap.pop()
    seq = 0
    now = 0.0
    n_done = 0
    while True:
        # ---- dispatch (engine.sim._dispatch): ready ops by rank, per device
        for a in range(n_new):
            i = newly[a]
            d = dev[i]
            r = rank[i]
            pos = qlen[d]
            while pos > 0 and queue[d, pos - 1] > r:
                queue[d, pos] = queue[d, pos - 1]
                pos -= 1
            queue[d, pos] = r
            qlen[d] += 1
        n_new = 0
        for d in range(n_dev):
            q_n = qlen[d]
            f = free[d]
            j = 0
            while f > 0 and j < q_n:
                i = order[queue[d, j]]
                k = thr[i]
                if k > f:
                    j += 1
                    continue
                for m in range(j, q_n - 1):
                    queue[d, m] = queue[d, m + 1]
                q_n -= 1
                f -= k
                # ---- SimState.start_unchecked
                free[d] -= k
                arrive = now
                for e in range(pptr[i], pptr[i + 1]):
                    p = pidx[e]
                    if dev[p] != d:
                        t = end_time[p] + xt[e]
                        if t > arrive:
                            arrive = t
                if arrive > now:
                    seq += 1
                    heapq.heappush(heap, (arrive, seq, i, -1))
                else:  # SimState._begin
                    last[i] = now
                    rate[i] = 0.0
                    computing[d, clen[d]] = i
                    clen[d] += 1
                    if not dirty[d]:
                        dirty[d] = True
                        n_dirty += 1
            qlen[d] = q_n
        if n_done == n:
            return now, 0
        # ---- SimState.advance: flush, then complete every op ending at the next event time
        completed = False
        while True:
            if n_dirty:  # ---- SimState._flush (rates of the devices whose co-runners changed), devices ascending
                for d in range(n_dev):
                    if not dirty[d]:
                        continue
                    c = clen[d]
                    if c == 0:
                        continue
                    bw = bandwidth[d]
                    tot = 0.0
                    if c > 1:
                        for m in range(c):
                            tot += demand[computing[d, m]]  # the general loop's sum, in the same order
                    if c == 1 or tot <= bw:
                        if not gpu_occ[d] and busy[d] == 0.0:
                            for m in range(c):
                                i = computing[d, m]
                                if rate[i] != 1.0:
                                    w = work[i] - (now - last[i]) * rate[i]
                                    if w < 0.0:
                                        w = 0.0
                                    work[i] = w
                                    last[i] = now
                                    rate[i] = 1.0
                                    ver[i] += 1
                                    seq += 1
                                    heapq.heappush(heap, (now + w, seq, i, ver[i]))
                            continue
                        for m in range(c):
                            rates[m] = 1.0
                    elif tot <= 0:  # corun_rates
                        for m in range(c):
                            rates[m] = 1.0
                    else:
                        over = tot / bw - 1.0
                        for m in range(c):
                            x = demand[computing[d, m]]
                            rates[m] = 1.0 / (1.0 + (x / bw if x < bw else 1.0) * over) if x > 0 else 1.0
                    if gpu_occ[d]:
                        share = 0.0
                        for m in range(c):
                            share += occ[computing[d, m], d]
                        if share > 1.0:
                            cap = 1.0 / share
                            for m in range(c):
                                if not rates[m] < cap:
                                    rates[m] = cap
                    if busy[d] != 0.0:  # SimState._busy_share
                        want_n = 0
                        for m in range(c):
                            i = computing[d, m]
                            want_n += thr[i] if parallel[i] else 1
                        want = want_n + busy[d]
                        cores = caps[d]
                        if want > cores:
                            fair = cores / want
                            team = 1.0 / math.ceil(want / cores)
                            for m in range(c):
                                i = computing[d, m]
                                rates[m] = rates[m] * (team if thr[i] > 1 and parallel[i] else fair)
                    for m in range(c):
                        i = computing[d, m]
                        r = rates[m]
                        r0 = rate[i]
                        if r != r0:
                            w = work[i] - (now - last[i]) * r0
                            if w < 0.0:
                                w = 0.0
                            work[i] = w
                            last[i] = now
                            rate[i] = r
                            ver[i] += 1
                            seq += 1
                            heapq.heappush(heap, (now + w / r, seq, i, ver[i]))
                for d in range(n_dev):
                    dirty[d] = False
                n_dirty = 0
            while len(heap) > 0:
                v = heap[0][3]
                if v < 0 or v == ver[heap[0][2]]:
                    break
                heapq.heappop(heap)  # a finish time superseded by a rate change
            if len(heap) == 0:
                if completed:
                    break
                return now, n - n_done
            t = heap[0][0]
            if completed and t > now:
                break
            if t > now:
                now = t
            while len(heap) > 0 and heap[0][0] <= t:
                item = heapq.heappop(heap)
                i = item[2]
                v = item[3]
                d = dev[i]
                if v == -1:  # SimState._begin: the op's inputs arrived
                    last[i] = now
                    rate[i] = 0.0
                    computing[d, clen[d]] = i
                    clen[d] += 1
                    if not dirty[d]:
                        dirty[d] = True
                        n_dirty += 1
                elif v == ver[i]:  # SimState._complete
                    end_time[i] = now
                    n_done += 1
                    free[d] += thr[i]
                    c = clen[d]
                    m = 0
                    while computing[d, m] != i:
                        m += 1
                    for m2 in range(m, c - 1):
                        computing[d, m2] = computing[d, m2 + 1]
                    clen[d] = c - 1
                    if not dirty[d]:
                        dirty[d] = True
                        n_dirty += 1
                    for e in range(sptr[i], sptr[i + 1]):
                        j = sidx[e]
                        pending[j] -= 1
                        if pending[j] == 0:
                            newly[n_new] = j
                            n_new += 1
                    completed = True


def available() -> bool:
    """Whether the compiled loop is there (numba installed, ``OPSCHED_NO_JIT`` unset);
    compiles it (or loads it from the cache) on the first call."""
    return _compiled() is not None


def lazily_compiled(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """A getter of ``fn`` compiled by numba: compiled (or loaded from the cache on disk,
    ``<opsched cache>/numba``) on the first call, once per process; None without numba
    or with ``OPSCHED_NO_JIT`` set.  The replay's loops here and HEFT's processor
    selection (:mod:`opsched.policies.heft`) are compiled through it."""
    return functools.cache(lambda: _compile(fn))


#: :func:`_loop` and :func:`_merge_holds` compiled (see :func:`lazily_compiled`).
_compiled = lazily_compiled(_loop)
_compiled_merge = lazily_compiled(_merge_holds)


def _compile(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    if os.environ.get(NO_JIT_ENV, "") not in ("", "0"):
        return None
    try:
        import numba
        from numba.core import config
    except ImportError:
        return None
    from opsched.cache import root

    # numba picks a function's cache folder when caching is enabled (at decoration): point it at
    # opsched's cache for this function only, then put numba's setting back for everyone else's code
    saved = getattr(config, "CACHE_DIR", "")
    try:
        if not saved:
            setattr(config, "CACHE_DIR", str(root() / "numba"))  # noqa: B010 - not a declared attribute
        return numba.njit(cache=True, nogil=True)(fn)
    except (OSError, RuntimeError):  # no writable cache folder: compile per process
        return numba.njit(nogil=True)(fn)
    finally:
        setattr(config, "CACHE_DIR", saved)  # noqa: B010


__all__ = ["NO_JIT_ENV", "available", "corun_rates", "fast_makespan", "fast_slot_makespan", "lazily_compiled", "supports"]
