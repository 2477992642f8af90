"""HEFT: Heterogeneous Earliest Finish Time (Topcuoglu, Hariri and Wu, IEEE
TPDS 13(3), 2002).

The algorithm, as published:

1. *Task prioritizing*: ``upward_rank(i) = mean_comp(i) + max over successors
   j of (mean_comm(i, j) + upward_rank(j))``, with the computation cost
   averaged over the processors and the communication cost averaged over
   processor pairs; tasks are taken in decreasing upward rank.
2. *Processor selection*: each task goes to the processor that gives it the
   earliest finish time, where it may be *inserted* into an idle gap between
   two tasks already scheduled there (the insertion-based policy), not only
   appended after the last one.

:func:`heft_schedule` runs it on an explicit cost table (tasks x processors,
plus per-edge communication costs), so it can be checked against the paper's
worked example.  :class:`HeftPolicy` builds that table for an OpGraph: the
"processors" are *lanes* -- each GPU stream, and the CPU split into ``E``
executors of ``T`` threads (every split of the CPU's thread levels is tried,
keeping the one HEFT itself predicts fastest) -- and turns the schedule into a
Plan whose ``after`` chains replay each lane's order.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from opsched.engine.contracts import PerfModel, TimeTable
from opsched.engine.fast_replay import lazily_compiled
from opsched.graph import OpGraph, kahn_order
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import PRUNE_RTOL, Policy, build_plan, lane_after, resolve_model, split_bound
from opsched.policies.registry import BASELINE, HINT, TEACHER, register

#: transfer(src task, dst task, src group, dst group) -> communication cost.
Transfer = Callable[[int, int, int, int], float]


@dataclass(frozen=True)
class HeftSchedule:
    """HEFT's result: per task its processor, start and finish time."""

    proc: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    rank: np.ndarray
    order: tuple[int, ...]
    #: per task, the tasks it follows on its processor (every processor for a wide task); without
    #: insertion only (with insertion a task may go between two others), else empty
    prev: tuple[tuple[int, ...], ...] = ()

    @property
    def makespan(self) -> float:
        return float(self.finish.max()) if len(self.finish) else 0.0

    def lanes(self, n_procs: int) -> list[list[int]]:
        """Each processor's tasks in start order (ties: HEFT's priority order)."""
        pos = {t: k for k, t in enumerate(self.order)}
        out: list[list[int]] = [[] for _ in range(n_procs)]
        for t in sorted(range(len(self.proc)), key=lambda t: (self.start[t], pos[t])):
            out[int(self.proc[t])].append(t)
        return out


def upward_rank_table(mean_comp: np.ndarray, succ: Sequence[Sequence[int]],
                      mean_comm: Mapping[tuple[int, int], float], topo: Sequence[int]) -> np.ndarray:
    """HEFT's upward rank from mean computation and mean communication costs."""
    rank = np.zeros(len(mean_comp))
    for i in reversed(topo):
        best = 0.0
        for j in succ[i]:
            best = max(best, mean_comm.get((i, j), 0.0) + rank[j])
        rank[i] = mean_comp[i] + best
    return rank


def heft_schedule(comp: np.ndarray, comm: Mapping[tuple[int, int], float],
                  edges: Iterable[tuple[int, int]] | None = None, *,
                  groups: Sequence[int] | None = None, transfer: Transfer | None = None,
                  mean_comm: Mapping[tuple[int, int], float] | None = None,
                  insertion: bool = True, order: Sequence[int] | None = None,
                  wide: Sequence[bool] | np.ndarray | None = None, segment_cost: float = 0.0,
                  assign: Sequence[int] | None = None, tolerance: float = 0.0,
                  edge_cost: np.ndarray | None = None, jit: bool = True) -> HeftSchedule:
    """Schedule tasks ``0..n-1`` on processors ``0..p-1`` with HEFT.

    ``comp[i, q]``: computation cost of task ``i`` on processor ``q``.
    ``comm[(i, j)]``: communication cost of edge ``i -> j`` when the two tasks
    sit on different processors (zero on the same one), as in the paper.
    ``edges`` defaults to the keys of ``comm`` (list zero-cost edges explicitly).

    For machines whose link costs depend on the processor pair, ``groups[q]``
    names processor ``q``'s device (processors of one device share memory),
    ``transfer(i, j, g_i, g_j)`` gives the cost between two *different*
    devices, and ``mean_comm`` the per-edge average used for the ranks.

    Options for lane schedules (the ONNX Runtime lane planner,
    :mod:`opsched.policies.ort_lanes`; all need ``insertion=False``):
    ``order`` -- the priority order to take tasks in (default: decreasing
    upward rank, ties in topological order); ``wide[i]`` -- task ``i`` takes
    every processor (it starts once all are free and ends on all of them);
    ``segment_cost`` -- added to a task that starts a new *segment* on its
    processor: one with an input from another processor's (non-wide) task, or
    placed after a task another processor reads (a wide task always, when there
    is more than one processor); ``assign[i]`` -- the processor task ``i``
    must take (no choice); ``tolerance`` -- a processor replaces the best so
    far only when it finishes more than this much earlier.

    ``edge_cost[k, a, b]`` (with ``edges`` and ``groups``): the cost of edge
    ``edges[k]`` from device ``a`` to device ``b``, what ``transfer`` returns,
    as a table; the processor selection then runs as one compiled loop
    (:func:`_select`, numba; ``jit=False`` runs it as Python), the same
    floats in the same order as the loop below, so the same schedule.
    :class:`HeftPolicy` calls HEFT once per CPU executor split tried, and on a
    machine with GPUs this loop was half of its time.
    """
    comp = np.asarray(comp, dtype=float)
    if comp.ndim != 2 or comp.shape[1] < 1:
        raise ValueError(f"comp must be a (tasks x processors) table, got shape {comp.shape}")
    if not np.all(np.isfinite(comp)) or np.any(comp < 0):
        raise ValueError("comp must hold finite costs >= 0")
    n, p = comp.shape
    edge_list = sorted({(int(a), int(b)) for a, b in (comm.keys() if edges is None else edges)})
    for a, b in edge_list:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"edge ({a}, {b}) is not between two of the {n} tasks")
    for key, c in comm.items():
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"communication cost of edge {key} must be finite and >= 0, got {c}")
    pred: list[list[int]] = [[] for _ in range(n)]
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edge_list:
        pred[b].append(a)
        succ[a].append(b)
    topo = _topological(n, pred, succ)
    group = np.arange(p) if groups is None else np.asarray(groups, dtype=int)
    if group.shape != (p,):
        raise ValueError(f"groups must give one device per processor ({p}), got {group.shape}")
    if transfer is None:
        def by_edge(i: int, j: int, gi: int, gj: int) -> float:
            return comm.get((i, j), 0.0)

        transfer = by_edge
    rank = upward_rank_table(comp.mean(axis=1), succ, comm if mean_comm is None else mean_comm, topo)
    topo_pos = np.empty(n, dtype=int)
    topo_pos[list(topo)] = np.arange(n)
    # ties (also those floating-point sums create) go to the earlier task in topological order
    scale = float(rank.max()) if n and rank.max() > 0 else 1.0
    key = np.round(rank / scale, 12)
    order = tuple(sorted(range(n), key=lambda i: (-key[i], topo_pos[i]))) if order is None else tuple(order)
    lanes_mode = wide is not None or segment_cost > 0 or assign is not None
    if lanes_mode and insertion:
        raise ValueError("wide tasks, segment costs and fixed assignments need insertion=False")
    if lanes_mode:
        return _lane_schedule(comp, pred, order, rank, group, transfer, np.zeros(n, bool) if wide is None
                              else np.asarray(wide, bool), float(segment_cost), assign, float(tolerance))

    n_groups = int(group.max()) + 1 if p else 0
    if edge_cost is not None and edges is not None and n and p:
        loop = _compiled_select() if jit else _select
        if loop is not None:  # the same loop compiled: the same schedule, float for float (tested)
            index = {(int(a), int(b)): k for k, (a, b) in enumerate(edges)}
            pptr = np.zeros(n + 1, np.int64)
            np.cumsum([len(x) for x in pred], out=pptr[1:])
            pidx = np.array([j for x in pred for j in x], np.int64)
            pedge = np.array([index[j, i] for i, x in enumerate(pred) for j in x], np.int64)
            proc, start, finish = loop(np.asarray(order, np.int64), pptr, pidx, pedge, group.astype(np.int64),
                                       n_groups, comp, np.asarray(edge_cost, np.float64), bool(insertion))
            return HeftSchedule(proc.astype(int), start, finish, rank, order)
    # the hot loop on Python lists and floats (numpy scalar indexing costs more
    # than the arithmetic; the values and their order of operations are the same)
    costs: list[list[float]] = comp.tolist()
    grp: list[int] = group.tolist()
    proc_l = [-1] * n
    start_l = [0.0] * n
    finish_l = [0.0] * n
    starts: list[list[float]] = [[] for _ in range(p)]
    finishes: list[list[float]] = [[] for _ in range(p)]
    inf = float("inf")
    for i in order:
        # data-ready time of task i on each device (group)
        drt = [0.0] * n_groups
        for j in pred[i]:
            gj = grp[proc_l[j]]
            fj = finish_l[j]
            for g in range(n_groups):
                t = fj if g == gj else fj + transfer(j, i, gj, g)
                if t > drt[g]:
                    drt[g] = t
        best_q, best_s, best_f, best_k = -1, 0.0, inf, 0
        row = costs[i]
        for q in range(p):
            w = row[q]
            ready = drt[grp[q]]
            if ready + w >= best_f:
                # it cannot start before `ready`, so it cannot finish first: no gap search (this also
                # skips every other processor free by `ready` of a device with the same cost)
                continue
            sq = starts[q]
            fq = finishes[q]
            if not sq or fq[-1] <= ready:  # free by `ready` (idle, or its last task done)
                s, k = ready, len(sq)
            elif insertion:  # the earliest gap of length w from `ready` (inlined: the innermost loop of a plan)
                k = bisect_right(fq, ready)  # intervals before k end by `ready`, those from k after it
                m = len(sq)
                s = ready  # the gap before interval k starts at `ready`, every later one at an interval's end
                while k < m:
                    if s + w <= sq[k]:
                        break
                    s = fq[k]
                    k += 1
            else:
                s, k = fq[-1], len(sq)  # not free by `ready`: after its last task
            if s + w < best_f:
                best_q, best_s, best_f, best_k = q, s, s + w, k
        proc_l[i], start_l[i], finish_l[i] = best_q, best_s, best_f
        starts[best_q].insert(best_k, best_s)
        finishes[best_q].insert(best_k, best_f)
    return HeftSchedule(np.asarray(proc_l, dtype=int), np.asarray(start_l, dtype=float),
                        np.asarray(finish_l, dtype=float), rank, order)


def _select(order: np.ndarray, pptr: np.ndarray, pidx: np.ndarray, pedge: np.ndarray, grp: np.ndarray,
            n_groups: int, costs: np.ndarray, edge_cost: np.ndarray,
            insertion: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HEFT's processor selection (:func:`heft_schedule`'s loop) over arrays, numba-compilable:
    per task in ``order`` the processor with the earliest finish time, inserted into the first
    gap that fits when ``insertion``.  Predecessors in CSR (``pptr``, ``pidx``; ``pedge``: each
    one's row of ``edge_cost``); each processor's intervals in start order, in rows of
    ``starts`` / ``finishes``.  Returns (processor, start, finish) per task."""
    n, p = costs.shape
    proc = np.full(n, -1, np.int64)
    start = np.zeros(n)
    finish = np.zeros(n)
    starts = np.empty((p, n))
    finishes = np.empty((p, n))
    count = np.zeros(p, np.int64)
    drt = np.zeros(max(n_groups, 1))
    inf = np.inf
    for a in range(len(order)):
        i = order[a]
        for g in range(n_groups):  # data-ready time of task i on each device (group)
            drt[g] = 0.0
        for e in range(pptr[i], pptr[i + 1]):
            j = pidx[e]
            gj = grp[proc[j]]
            fj = finish[j]
            for g in range(n_groups):
                t = fj if g == gj else fj + edge_cost[pedge[e], gj, g]
                if t > drt[g]:
                    drt[g] = t
        best_q, best_s, best_f, best_k = -1, 0.0, inf, 0
        for q in range(p):
            w = costs[i, q]
            ready = drt[grp[q]]
            if ready + w >= best_f:
                continue
            m = count[q]
            if m == 0 or finishes[q, m - 1] <= ready:
                s, k = ready, m
            elif insertion:
                lo, hi = 0, m  # bisect_right(finishes[q, :m], ready)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if ready < finishes[q, mid]:
                        hi = mid
                    else:
                        lo = mid + 1
                k = lo
                s = ready
                while k < m:
                    if s + w <= starts[q, k]:
                        break
                    s = finishes[q, k]
                    k += 1
            else:
                s, k = finishes[q, m - 1], m
            if s + w < best_f:
                best_q, best_s, best_f, best_k = q, s, s + w, k
        proc[i], start[i], finish[i] = best_q, best_s, best_f
        m = count[best_q]
        for t in range(m, best_k, -1):
            starts[best_q, t] = starts[best_q, t - 1]
            finishes[best_q, t] = finishes[best_q, t - 1]
        starts[best_q, best_k] = best_s
        finishes[best_q, best_k] = best_f
        count[best_q] = m + 1
    return proc, start, finish


#: :func:`_select` compiled (once per process; None without numba or with ``OPSCHED_NO_JIT``).
_compiled_select = lazily_compiled(_select)


def _lane_schedule(comp: np.ndarray, pred: list[list[int]], order: tuple[int, ...], rank: np.ndarray,
                   group: np.ndarray, transfer: Transfer, wide: np.ndarray, segment_cost: float,
                   assign: Sequence[int] | None, tolerance: float) -> HeftSchedule:
    """HEFT without insertion, with wide tasks, segment costs and fixed assignments (see :func:`heft_schedule`)."""
    n, p = comp.shape
    free = [0.0] * p
    last = [-1] * p
    proc = np.zeros(n, dtype=int)
    start = np.zeros(n)
    finish = np.zeros(n)
    prev: list[tuple[int, ...]] = [()] * n
    read_elsewhere = [False] * n

    def ready_on(i: int, q: int) -> float:
        t = 0.0
        for j in pred[i]:
            qj = int(proc[j])
            r = finish[j] if (qj == q or wide[j]) else finish[j] + transfer(j, i, int(group[qj]), int(group[q]))
            t = max(t, r)
        return t

    for i in order:
        if wide[i] or p == 1:
            s = max(ready_on(i, 0), *free)
            prev[i] = tuple(x for x in set(last) if x >= 0)
            proc[i], start[i] = 0, s
            finish[i] = s + comp[i, 0] + (segment_cost if p > 1 else 0.0)
            free = [float(finish[i])] * p
            last = [i] * p
            continue
        best: tuple[float, int, float] | None = None
        for q in (range(p) if assign is None else (int(assign[i]),)):
            s = max(ready_on(i, q), free[q])
            cut = (last[q] >= 0 and read_elsewhere[last[q]]) or any(int(proc[j]) != q and not wide[j]
                                                                   for j in pred[i])
            f = s + comp[i, q] + (segment_cost if cut else 0.0)
            if best is None or f < best[0] - tolerance:
                best = (f, q, s)
        f, q, s = best  # type: ignore[misc]
        for j in pred[i]:
            if int(proc[j]) != q and not wide[j]:
                read_elsewhere[j] = True
        if last[q] >= 0:
            prev[i] = (last[q],)
        proc[i], start[i], finish[i] = q, s, f
        free[q] = f
        last[q] = i
    return HeftSchedule(proc, start, finish, rank, order, tuple(prev))


def _topological(n: int, pred: list[list[int]], succ: list[list[int]]) -> list[int]:
    """Kahn's algorithm, lowest index first among ready tasks."""
    out = kahn_order({i: len(pred[i]) for i in range(n)}, succ)
    if len(out) != n:
        raise ValueError("the task graph has a cycle")
    return out


#: HEFT's plans by (graph, machine, model) identity (see :meth:`HeftPolicy.plan`).
_PLANS = IdentityLRU(64)


def clear_plans() -> None:
    """Forget every cached HEFT plan (benchmarks that time planning from scratch)."""
    _PLANS.clear()


@register("heft", roles=(BASELINE, HINT, TEACHER), order=4)
class HeftPolicy(Policy):
    """HEFT on an OpGraph and a Machine (see the module docstring)."""

    name = "heft"

    def __init__(self, insertion: bool = True) -> None:
        self.insertion = insertion
        self._cost_key: tuple | None = None
        self._cost: np.ndarray = np.zeros((0, 0, 0))  # _costs' last result (for _cost_key)
        self._by_edge: dict[tuple[int, int], list[list[float]]] = {}  # the same by edge, as lists

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        """HEFT's plan (cached per (graph, machine, model) for the default insertion policy:
        the hint heuristics plan it, and CPA, biCPA and LP rounding start from its GPU
        placement, on the same graph one after another; :func:`clear_plans` forgets)."""
        if not self.insertion:
            return self._plan(graph, machine, model)
        owners = (graph, machine) if model is None else (graph, machine, model)
        return _PLANS.get_or_make((id(graph), id(machine), id(model)), lambda: self._plan(graph, machine, model),
                                  *owners)

    def _plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None) -> Plan:
        model = resolve_model(model)
        table = model.time_table(graph, machine)
        # Each CPU executor split is scheduled only when it could win: HEFT's makespan on
        # those lanes is at least the critical path at each op's fastest lane and the
        # fastest-lane work over the lanes (transfers only add), so a split whose bound
        # exceeds the best makespan so far is left out (splits in the order of their bounds;
        # the first fastest in thread-level order is kept, as when every split is scheduled).
        splits = sorted((self._bound(graph, machine, table, t), k, t)
                        for k, t in enumerate(machine.cpu.thread_levels()))
        best: tuple[HeftSchedule, list[tuple[int, int]], int, int] | None = None
        for bound, k, cpu_threads in splits:
            if best is not None and bound > best[0].makespan * (1.0 + PRUNE_RTOL):
                continue
            lanes = self._lanes(machine, cpu_threads)
            sched = self._schedule(graph, machine, model, table, lanes)
            if best is None or (sched.makespan, k) < (best[0].makespan, best[3]):
                best = (sched, lanes, cpu_threads, k)
        sched, lanes, cpu_threads, _ = best  # type: ignore[misc]
        lane_ops = sched.lanes(len(lanes))
        after = lane_after(graph, lane_ops)
        assignments = {}
        for i, op in enumerate(graph.ops):
            d, threads = lanes[int(sched.proc[i])]
            assignments[op.id] = Assignment(machine.devices[d].id, threads, float(sched.rank[i]), after[i])
        return build_plan(graph, machine, assignments, policy=self.name,
                          cpu_executors=machine.cpu.cores // cpu_threads, cpu_threads=cpu_threads,
                          predicted_makespan=sched.makespan)

    def _bound(self, graph: OpGraph, machine: Machine, table: TimeTable, cpu_threads: int) -> float:
        """A lower bound on HEFT's makespan with the CPU split into executors of ``cpu_threads``."""
        lanes = self._lanes(machine, cpu_threads)
        fastest = np.min(np.stack([table.on(d, t) for d, t in dict.fromkeys(lanes)]), axis=0)
        return split_bound(graph.upward_rank_array(fastest), fastest, len(lanes))

    @staticmethod
    def _lanes(machine: Machine, cpu_threads: int) -> list[tuple[int, int]]:
        """(device index, threads) per processor: CPU executors, then GPU streams."""
        lanes = []
        for d, dev in enumerate(machine.devices):
            if dev.is_gpu:
                lanes += [(d, 1)] * dev.cores
            else:
                lanes += [(d, cpu_threads)] * (dev.cores // cpu_threads)
        return lanes

    def _costs(self, graph: OpGraph, machine: Machine,
               model: PerfModel) -> tuple[np.ndarray, dict[tuple[int, int], list[list[float]]]]:
        """(edges, devices, devices): each edge's transfer cost between two devices
        (0 on one device), in ``graph.edge_bytes`` order; and the same by edge as nested
        lists of Python floats (the hot loop reads one entry per edge and device pair, and
        numpy scalar indexing costs more).  Computed once per plan and per distinct byte
        count (the executor splits tried share it)."""
        key = (id(graph), id(machine), id(model))
        if self._cost_key == key:
            return self._cost, self._by_edge
        dev_ids = [dev.id for dev in machine.devices]
        nd = len(dev_ids)
        by_size: dict[float, np.ndarray] = {}
        sizes = list(graph.edge_bytes.values())
        cost = np.zeros((len(sizes), nd, nd))
        for e, nbytes in enumerate(sizes):
            c = by_size.get(nbytes)
            if c is None:
                c = by_size[nbytes] = np.array([[model.transfer_time(nbytes, dev_ids[a], dev_ids[b], machine)
                                                 if a != b else 0.0 for b in range(nd)] for a in range(nd)])
            cost[e] = c
        self._cost_key, self._cost, self._by_edge = key, cost, dict(zip(graph.edge_bytes, cost.tolist()))
        return cost, self._by_edge

    def _schedule(self, graph: OpGraph, machine: Machine, model: PerfModel, table: TimeTable,
                  lanes: list[tuple[int, int]]) -> HeftSchedule:
        comp = np.empty((len(graph.ops), len(lanes)))
        for q, (d, threads) in enumerate(lanes):
            comp[:, q] = table.on(d, threads)
        groups = [d for d, _ in lanes]
        dev_ids = [dev.id for dev in machine.devices]
        counts = np.bincount(groups, minlength=len(dev_ids)).astype(float)
        n_lanes = len(lanes)
        edge_bytes = graph.edge_bytes
        cost, by_edge = self._costs(graph, machine, model)
        # the mean over ordered pairs of distinct lanes (same-device pairs cost 0)
        means = np.einsum("a,eab,b->e", counts, cost, counts) / (n_lanes * (n_lanes - 1)) if n_lanes > 1 \
            else np.zeros(len(edge_bytes))
        mean_comm = dict(zip(edge_bytes, means.tolist()))

        def transfer(i: int, j: int, a: int, b: int) -> float:
            return by_edge[i, j][a][b]

        return heft_schedule(comp, {e: 0.0 for e in edge_bytes}, list(edge_bytes), groups=groups,
                             transfer=transfer, mean_comm=mean_comm, insertion=self.insertion, edge_cost=cost)
