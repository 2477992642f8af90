"""Honest ceilings: lower bounds on the makespan of any plan, and CP-SAT's best schedule.

Two bounds, both for the plans the simulator runs (:mod:`opsched.engine.sim`)
under one performance model:

* :func:`allocation_lp_bound` -- the **allocation LP**, the linear relaxation
  of the discrete time-cost trade-off that the moldable-task literature
  rounds (Skutella 1998; Lepere, Trystram and Woeginger 2002; Jansen and
  Zhang 2006).  Each op picks a convex combination of its (device, thread
  level) allocations; the LP minimises ``T`` subject to ``T >=`` every path's
  length (start-time variables with one constraint per edge), ``T >=`` each
  device's work (threads x time) over its slots, on a GPU ``T >=`` the sum of
  occupancy x time (the simulator shares a GPU among kernels whose shares
  exceed 1), and a transfer on an edge whose ends the LP puts on different
  devices.  It is never below :func:`opsched.engine.sim.lower_bound` (the same
  two terms at each op's best allocation) and costs one HiGHS solve
  (``scipy.optimize.linprog``), milliseconds for a few hundred ops.
* :func:`cpsat_schedule` -- OR-Tools CP-SAT on the multi-mode scheduling
  problem the simulator poses without co-run interference: every op one
  (device, thread level) mode, a cumulative of threads per device, transfers
  between devices on the edges.  With a time limit it returns an incumbent
  (as a Plan the simulator replays) and CP-SAT's proven bound.

Why both are lower bounds of every simulated makespan (the argument the tests
check on random graphs and every preset): take any simulated run and give
each op its plan's allocation and its compute start.  The simulator never runs
an op faster than its alone time (interference, runtime costs and GPU sharing
only slow it), an op holds its thread slots for at least that long, its
compute starts after each producer ends plus the transfer between their
devices, and while kernels share a GPU each progresses at most at ``1 /``
(sum of shares).  So the run is a feasible point of both relaxations, with
the same makespan or more.  Two details keep the bounds valid, not just
tight: transfers enter the LP through the fraction of the op's placement that
differs from its producer's (``1/2 sum_d |x_i(d) - x_j(d)|``, exactly 1 for
two different devices) times the *cheapest* link between any two devices for
that edge's bytes; CP-SAT's durations and transfers are rounded *down* to its
time unit.  On a CPU with busy cores (``Device.busy_cores``) the simulator
runs a team wider than the free cores at the pace of its slowest thread and
shares the cores with the load, so both bounds price a team at that pace and
the LP's slot capacity at ``cores^2 / (cores + busy)`` (see :func:`allocations`).  The LP is solved in units of the old bound (so HiGHS's absolute
tolerances are relative ones) and reported ``(1 - 1e-6)`` low.

Thread counts: opsched's policies give ops the device's thread levels
(``Device.thread_levels()``), and by default both bounds range over those
allocations, as :func:`~opsched.engine.sim.lower_bound` does.
``thread_counts="all"`` ranges over every count ``1..cores`` instead: a bound
for any plan at all (the LP then asks the model for the counts between the
levels, as the simulator does).

No import from ``backends`` or ``policies``: the engine's simulator tables
(:func:`~opsched.engine.sim.prepare`) are all this needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.engine.sim import (
    SimStatic,
    cached_fingerprint,
    plan_fingerprint,
    prepare,
    replay,
    replay_plan_makespan,
)
from opsched.errors import ExecutionError, OpschedError, PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan

#: The LP's optimum is reported this much low (relative), below HiGHS's tolerances.
LP_SAFETY = 1e-6
THREAD_COUNTS = ("levels", "all")


# ------------------------------------------------------------ allocations
@dataclass(frozen=True)
class Allocation:
    """One way to run an op: device index, threads, alone seconds."""

    device: int
    threads: int
    time: float


def allocations(static: SimStatic, thread_counts: str = "levels") -> list[list[Allocation]]:
    """Per op, every (device, thread count) allocation the bounds range over:
    the device's thread levels (``"levels"``) or every count up to its slots
    (``"all"``); a GPU op always takes one stream.  Infinite times (a level a
    table lacks) are left out.  On a CPU with busy cores a team of ``k > 1``
    threads that opens a parallel region is never faster than
    ``t(k) * ceil((k + busy) / cores)`` (the simulator's "Busy cores" rule:
    the team waits for its slowest thread), and that is its time here."""
    if thread_counts not in THREAD_COUNTS:
        raise ValueError(f"thread_counts must be one of {', '.join(THREAD_COUNTS)}, got {thread_counts!r}")
    out: list[list[Allocation]] = [[] for _ in range(static.n)]
    for d, dev in enumerate(static.devices):
        ks: Sequence[int] = static.levels[d] if thread_counts == "levels" or dev.is_gpu \
            else range(1, dev.cores + 1)
        busy = static.busy[d]
        for i in range(static.n):
            for k in ks:
                t = static.time_and_demand(i, d, int(k))[0]
                if busy and k > 1 and static.parallel[i]:
                    t *= math.ceil((k + busy) / dev.cores)
                if math.isfinite(t):
                    out[i].append(Allocation(d, int(k), float(t)))
    return out


def _hull(points: list[tuple[float, float, int]]) -> list[int]:
    """Indices of the lower-left convex hull of (time, work) points: the only
    allocations an LP over convex combinations ever needs (any other point is
    dominated, in both time and work, by a mix of these)."""
    pts = sorted(points)  # by time, then work
    front: list[tuple[float, float, int]] = []
    for p in pts:  # Pareto: work strictly falls as time grows
        if not front or p[1] < front[-1][1]:
            front.append(p)
    hull: list[tuple[float, float, int]] = []
    for p in front:
        while len(hull) >= 2:
            (t1, w1, _), (t2, w2, _) = hull[-2], hull[-1]
            # drop hull[-1] when it lies on or above the segment hull[-2] -> p
            if (t2 - t1) * (p[1] - w1) - (w2 - w1) * (p[0] - t1) <= 0.0:
                hull.pop()
            else:
                break
        hull.append(p)
    return [p[2] for p in hull]


def _simple_bound(static: SimStatic, cand: list[list[Allocation]]) -> float:
    """max(critical path at fastest times, best work / all slots) over ``cand``:
    :func:`opsched.engine.sim.lower_bound` when ``cand`` are the levels."""
    fastest = np.array([min(a.time for a in c) for c in cand])
    work = sum(min(a.time * a.threads for a in c) for c in cand)
    cp = float(static.graph.upward_rank_array(fastest).max())
    return max(cp, work / float(sum(static.caps)))


@dataclass(frozen=True)
class AllocationLP:
    """The allocation LP's solution.

    ``bound``: the valid lower bound (seconds).  ``lp_makespan``: the LP's
    optimum ``T`` (seconds; ``bound`` is this, a hair low, or the old bound if
    that is larger).  ``old_bound``: max(critical path, work / capacity) over
    the same allocations.  ``weights[i]``: op ``i``'s convex combination,
    ``{(device index, threads): weight}``; ``durations[i]``: its fractional
    time; ``placement[i, d]``: its weight on device ``d``."""

    bound: float
    lp_makespan: float
    old_bound: float
    weights: tuple[dict[tuple[int, int], float], ...]
    durations: np.ndarray
    placement: np.ndarray
    thread_counts: str
    status: str
    seconds: float
    candidates: tuple[tuple[Allocation, ...], ...] = field(repr=False, default=())


def allocation_lp(graph: OpGraph, machine: Machine, model: PerfModel | None = None, *,
                  thread_counts: str = "levels", transfers: bool = True,
                  placement: Mapping[str, str] | None = None) -> AllocationLP:
    """Solve the allocation LP of ``graph`` on ``machine`` (see the module docstring).

    ``placement`` (op id -> device id; ops not named stay on ``"cpu"``) fixes
    every op's device: the LP then chooses thread counts only, and each edge
    between two devices costs its exact transfer (the LP-rounding heuristic's
    candidates for a given placement; not a bound over all placements)."""
    from scipy import sparse
    from scipy.optimize import linprog

    t0 = time.perf_counter()
    s = prepare(graph, machine, model)
    n, nd = s.n, s.n_dev
    if n == 0:
        return AllocationLP(0.0, 0.0, 0.0, (), np.zeros(0), np.zeros((0, nd)), thread_counts, "empty", 0.0)
    full = allocations(s, thread_counts)
    fixed_dev = None
    if placement is not None:
        index = machine.device_index
        fixed_dev = [index[placement.get(op.id, "cpu")] for op in graph.ops]
        full = [[a for a in full[i] if a.device == fixed_dev[i]] for i in range(n)]
    old = _simple_bound(s, full)
    # per op and device, the hull of its allocations there
    cand: list[list[Allocation]] = []
    for i in range(n):
        keep: list[Allocation] = []
        for d in range(nd):
            mine = [a for a in full[i] if a.device == d]
            if mine:
                idx = _hull([(a.time, a.time * a.threads, k) for k, a in enumerate(mine)])
                keep += [mine[k] for k in idx]
        cand.append(keep)
    unit = old if old > 0 else 1.0
    col0 = np.cumsum([0] + [len(c) for c in cand])
    nx = int(col0[-1])
    s_col = nx                      # start times s_0..s_{n-1}
    t_col = nx + n                  # T
    edges = list(s.edge_bytes)
    cost = {}
    fixed_cost = {}
    if transfers and fixed_dev is not None:
        for e, (j, i) in enumerate(edges):
            if fixed_dev[j] != fixed_dev[i]:
                fixed_cost[e] = s.transfer(s.edge_bytes[(j, i)], fixed_dev[j], fixed_dev[i]) / unit
    elif transfers and nd > 1:
        for e, (j, i) in enumerate(edges):
            b = s.edge_bytes[(j, i)]
            c = min(s.transfer(b, a, bb) for a in range(nd) for bb in range(nd) if a != bb)
            if c > 0:
                cost[e] = c / unit
    z_of = {e: t_col + 1 + k * nd for k, e in enumerate(cost)}
    nvar = t_col + 1 + len(cost) * nd

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    b_ub: list[float] = []
    r = 0

    def add(c: int, v: float) -> None:
        rows.append(r)
        cols.append(c)
        vals.append(v)

    dur = [[a.time / unit for a in c] for c in cand]
    # precedence: s_j + p_j + transfer share - s_i <= 0
    for e, (j, i) in enumerate(edges):
        add(s_col + j, 1.0)
        add(s_col + i, -1.0)
        for k, t in enumerate(dur[j]):
            add(int(col0[j]) + k, t)
        if e in cost:
            for d in range(nd):
                add(z_of[e] + d, 0.5 * cost[e])
        b_ub.append(-fixed_cost.get(e, 0.0))
        r += 1
    # every sink ends by T
    for i in range(n):
        if not s.succs[i]:
            add(s_col + i, 1.0)
            for k, t in enumerate(dur[i]):
                add(int(col0[i]) + k, t)
            add(t_col, -1.0)
            b_ub.append(0.0)
            r += 1
    # per device: slot-seconds <= slots x T; on a GPU also occupancy-seconds <= T.  A CPU with busy cores
    # progresses at most cores^2 / (cores + busy) slot-seconds per second: its computing threads W <= cores
    # share the cores with the load, each at cores / (W + busy) at best (when every op opens a parallel
    # region, so its threads are its slots)
    capacity = [float(c) for c in s.caps]
    for d in range(nd):
        if s.busy[d] and all(s.parallel):
            capacity[d] = s.caps[d] ** 2 / (s.caps[d] + s.busy[d])
    for d in range(nd):
        for occ_row in (False, True):
            if occ_row and (s.occupancy is None or not s.gpus[d]):
                continue
            any_term = False
            for i in range(n):
                for k, a in enumerate(cand[i]):
                    if a.device != d:
                        continue
                    w = (s.occupancy[i][d] if occ_row else a.threads) * dur[i][k]  # type: ignore[index]
                    if w > 0:
                        add(int(col0[i]) + k, w)
                        any_term = True
            if any_term:
                add(t_col, -1.0 if occ_row else -capacity[d])
                b_ub.append(0.0)
                r += 1
    # transfer share: z[e, d] >= |x_i(d) - x_j(d)|
    for e, z0 in z_of.items():
        j, i = edges[e]
        for d in range(nd):
            for sign in (1.0, -1.0):
                for k, a in enumerate(cand[i]):
                    if a.device == d:
                        add(int(col0[i]) + k, sign)
                for k, a in enumerate(cand[j]):
                    if a.device == d:
                        add(int(col0[j]) + k, -sign)
                add(z0 + d, -1.0)
                b_ub.append(0.0)
                r += 1
    a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(r, nvar))
    eq_rows = [i for i in range(n) for _ in range(len(cand[i]))]
    a_eq = sparse.csr_matrix((np.ones(nx), (eq_rows, np.arange(nx))), shape=(n, nvar))
    c = np.zeros(nvar)
    c[t_col] = 1.0
    bounds = [(0.0, 1.0)] * nx + [(0.0, None)] * (n + 1) + [(0.0, 1.0)] * (nvar - t_col - 1)
    # the placement's absolute-value rows make the simplex crawl (symmetric GPUs); the interior point
    # method (with crossover) solves those LPs ten times faster, the simplex the others
    res = linprog(c, A_ub=a_ub, b_ub=np.array(b_ub), A_eq=a_eq, b_eq=np.ones(n), bounds=bounds,
                  method="highs-ipm" if z_of else "highs")
    seconds = time.perf_counter() - t0
    if res.status != 0 or res.x is None:
        # no LP solution: the old bound still holds
        return AllocationLP(old, float("nan"), old, (), np.full(n, np.nan), np.full((n, nd), np.nan),
                            thread_counts, f"HiGHS: {res.message}", seconds, tuple(tuple(c) for c in cand))
    x = np.clip(res.x[:nx], 0.0, 1.0)
    weights = []
    durations = np.zeros(n)
    on_device = np.zeros((n, nd))  # AllocationLP.placement (the parameter ``placement`` is the fixed one)
    for i in range(n):
        mix: dict[tuple[int, int], float] = {}
        for k, a in enumerate(cand[i]):
            v = float(x[col0[i] + k])
            if v > 1e-9:
                mix[(a.device, a.threads)] = mix.get((a.device, a.threads), 0.0) + v
                durations[i] += v * a.time
                on_device[i, a.device] += v
        weights.append(mix)
    lp = float(res.fun) * unit
    return AllocationLP(max(old, lp * (1.0 - LP_SAFETY)), lp, old, tuple(weights), durations, on_device,
                        thread_counts, "optimal", seconds, tuple(tuple(c) for c in cand))


def allocation_lp_bound(graph: OpGraph, machine: Machine, model: PerfModel | None = None, *,
                        thread_counts: str = "levels", transfers: bool = True) -> float:
    """The allocation LP's lower bound on any simulated makespan of ``graph`` on
    ``machine`` (seconds); see :func:`allocation_lp` and the module docstring."""
    return allocation_lp(graph, machine, model, thread_counts=thread_counts, transfers=transfers).bound


# ----------------------------------------------------------------- CP-SAT
def require_ortools() -> Any:
    """OR-Tools' CP-SAT module, or a one-line error saying how to get it."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise OpschedError(f"CP-SAT needs OR-Tools, which is not installed ({exc}); "
                           "pip install 'opsched[bench]'") from None
    return cp_model


@dataclass(frozen=True)
class CpSatResult:
    """CP-SAT's answer for one (graph, machine).

    ``plan``: the incumbent as a Plan (the better, in the simulator, of its
    start order alone and its start order with holds); ``makespan_s`` its
    simulated makespan; ``cp_makespan_s`` the incumbent's makespan in CP-SAT's
    relaxed problem (no interference, times rounded down); ``lower_bound_s``
    the proven bound (valid for every plan on the thread levels);
    ``optimal``: CP-SAT proved its incumbent optimal for the relaxed problem."""

    plan: Plan | None
    makespan_s: float
    cp_makespan_s: float
    lower_bound_s: float
    optimal: bool
    status: str
    seconds: float
    unit_s: float
    meta: dict[str, Any] = field(default_factory=dict)


#: The solver process of :func:`solve_isolated`: builds the CP-SAT model of a JSON problem (from
#: :func:`cpsat_schedule`), solves it, prints JSON.  The model: per op exactly one mode (device,
#: threads, duration) as optional intervals; per device a cumulative of threads within its slots; on a
#: GPU the occupancy-seconds within the makespan; each edge's consumer starts after its producer ends,
#: plus the transfer when their devices differ; minimise the makespan.
_SOLVER_CHILD = r"""
import json, sys
from ortools.sat.python import cp_model


def solve(P, limit, workers, seed, deterministic):
    n, nd, H = P["n"], P["nd"], P["horizon"]
    m = cp_model.CpModel()
    start = [m.NewIntVar(0, H, f"s{i}") for i in range(n)]
    end = [m.NewIntVar(0, H, f"e{i}") for i in range(n)]
    lits, on_dev = [], []
    per_dev = [([], []) for _ in range(nd)]
    occ = [[] for _ in range(nd)]
    for i, ms in enumerate(P["modes"]):
        ls = [m.NewBoolVar(f"m{i}_{k}") for k in range(len(ms))]
        m.AddExactlyOne(ls)
        lits.append(ls)
        for k, (d, thr, du) in enumerate(ms):
            iv = m.NewOptionalIntervalVar(start[i], du, end[i], ls[k], f"iv{i}_{k}")
            per_dev[d][0].append(iv)
            per_dev[d][1].append(thr)
            w = P["occupancy"][i][k]
            if w > 0:
                occ[d].append((ls[k], w))
        devs = []
        for d in range(nd):
            mine = [ls[k] for k, (dd, _, _) in enumerate(ms) if dd == d]
            if not mine:
                devs.append(None)
            elif len(mine) == 1:
                devs.append(mine[0])
            else:
                v = m.NewBoolVar(f"d{i}_{d}")
                m.Add(sum(mine) == v)
                devs.append(v)
        on_dev.append(devs)
    for d in range(nd):
        if per_dev[d][0]:
            m.AddCumulative(per_dev[d][0], per_dev[d][1], P["caps"][d])
    span = m.NewIntVar(0, H, "makespan")
    for d in range(nd):
        if occ[d]:
            m.Add(sum(w * lit for lit, w in occ[d]) <= 1000 * span)
    for j, i in P["edges"]:
        m.Add(start[i] >= end[j])
    for j, i, a, b, c in P["xfer"]:
        if on_dev[j][a] is not None and on_dev[i][b] is not None:
            m.Add(start[i] >= end[j] + c).OnlyEnforceIf([on_dev[j][a], on_dev[i][b]])
    for i in P["sinks"]:
        m.Add(span >= end[i])
    if P["lower"] > 0:
        m.Add(span >= P["lower"])
    m.Minimize(span)
    for i, k, t in P["hint"] or []:
        for kk, lit in enumerate(lits[i]):
            m.AddHint(lit, kk == k)
        m.AddHint(start[i], t)
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = limit
    if deterministic > 0:
        s.parameters.max_deterministic_time = deterministic
    s.parameters.num_workers = workers
    s.parameters.random_seed = seed
    status = s.Solve(m)
    ok = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    out = {"status": s.StatusName(status), "objective": s.ObjectiveValue() if ok else None,
           "bound": s.BestObjectiveBound()}
    if ok:
        out["mode"] = [next(k for k, lit in enumerate(ls) if s.Value(lit)) for ls in lits]
        out["start"] = [s.Value(v) for v in start]
        out["end"] = [s.Value(v) for v in end]
    return out


if sys.argv[1] == "serve":  # one problem per line, one answer per line (CpSatServer)
    for line in sys.stdin:
        if line.strip():
            R = json.loads(line)
            print(json.dumps(solve(R["problem"], R["limit"], R["workers"], R["seed"], R["deterministic"])),
                  flush=True)
else:
    json.dump(solve(json.load(sys.stdin), float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 0.0),
              sys.stdout)
"""


def solve_isolated(problem: dict[str, Any], time_limit_s: float, workers: int = 1, seed: int = 0) -> dict[str, Any]:
    """Build and solve :func:`cpsat_schedule`'s CP-SAT model in a child process (JSON in and out).

    Why a process: OR-Tools and TensorFlow both link their own abseil and protobuf, and CP-SAT
    in a process that has imported TensorFlow (a Keras model, the ``tf`` backend) segfaults as
    soon as it serialises a model (seen in the test suite).  The child imports nothing but
    OR-Tools; the problem and the answer are plain JSON (no pickle)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SOLVER_CHILD, str(float(time_limit_s)), str(int(workers)),
                           str(int(seed))], input=json.dumps(problem), capture_output=True, text=True,
                          timeout=float(time_limit_s) + 120.0)
    if proc.returncode != 0:
        raise OpschedError(f"CP-SAT's solver process failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return json.loads(proc.stdout)


class CpSatServer:
    """One long-lived solver process (:func:`solve_isolated`'s child, in
    "serve" mode) for many small problems: the training teacher
    (:mod:`opsched.agents.teachers`) solves hundreds of graphs of a few dozen
    ops, where starting Python and importing OR-Tools for each would cost
    more than the solve.  ``deterministic_s``: CP-SAT's deterministic time
    limit per problem (its work counter, not the clock: the same answer on a
    busy machine and a quiet one, so a cached teacher is reproducible); the
    wall-clock ``time_limit_s`` of each call stays as a safety cap.  Call it as
    :func:`cpsat_schedule`'s ``solver``."""

    def __init__(self, deterministic_s: float = 0.0) -> None:
        self.deterministic_s = float(deterministic_s)
        self._proc: Any = None
        self._err: Any = None

    def __call__(self, problem: dict[str, Any], time_limit_s: float, workers: int = 1,
                 seed: int = 0) -> dict[str, Any]:
        import json
        import subprocess
        import sys

        if self._proc is None or self._proc.poll() is not None:
            import tempfile

            # stderr to a file (a pipe nobody reads could fill and block the solver); its own session:
            # Ctrl-C reaches the caller, which stops it (close, or its stdin closing when the caller exits)
            self._err = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen([sys.executable, "-c", _SOLVER_CHILD, "serve"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._err, text=True,
                                          start_new_session=True)
        proc = self._proc
        request = {"problem": problem, "limit": float(time_limit_s), "workers": int(workers), "seed": int(seed),
                   "deterministic": self.deterministic_s}
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self.close()
            self._err.seek(0)
            err = self._err.read()
            raise OpschedError(f"CP-SAT's solver process failed (exit {proc.returncode}): {err.strip()[-500:]}")
        return json.loads(line)

    def close(self) -> None:
        """Stop the solver process (a later call starts a new one)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
                proc.wait()


def cpsat_schedule(graph: OpGraph, machine: Machine, model: PerfModel | None = None,
                   time_limit_s: float = 10.0, *, hint: Plan | None = None, lower_bound: float = 0.0,
                   workers: int = 1, seed: int = 0, resolution: int = 20000, max_ops: int = 400,
                   solver: Any = None) -> CpSatResult:
    """Schedule ``graph`` on ``machine`` with CP-SAT for at most ``time_limit_s`` seconds.

    The problem: per op exactly one mode (device, thread level) with its alone
    time; per device a cumulative of threads (streams on a GPU) within its
    slots; on a GPU the occupancy-seconds within the makespan; each edge's
    consumer starts after its producer ends, plus the transfer when their
    devices differ; minimise the makespan.  Times are integers in units of
    ``old bound / resolution``, rounded down (so the proven bound stays a bound).
    ``hint``: a Plan whose simulated schedule seeds the search (it is feasible
    for CP-SAT by the argument in the module docstring).  ``lower_bound``: a
    bound known to hold (e.g. :func:`allocation_lp_bound`), given to CP-SAT
    as ``makespan >= bound`` so it can prove an incumbent that meets it
    optimal; still valid, since the makespan variable is only bounded below
    by the ends (a real schedule maps to a point with makespan = its own).  ``workers``: CP-SAT's
    search threads (1 by default: a deterministic run).  Graphs of more than
    ``max_ops`` ops raise :class:`~opsched.errors.OpschedError`.  ``solver``:
    what solves the JSON problem (default :func:`solve_isolated`, a process
    per call; a :class:`CpSatServer` keeps one)."""
    require_ortools()  # a clear error here, not in the solver process (importing it next to TF is safe)
    t0 = time.perf_counter()
    s = prepare(graph, machine, model)
    n, nd = s.n, s.n_dev
    if n > max_ops:
        raise OpschedError(f"cpsat_schedule: graph {graph.name!r} has {n} ops, more than max_ops={max_ops}")
    if n == 0:
        return CpSatResult(None, 0.0, 0.0, 0.0, True, "empty", 0.0, 1.0)
    modes = allocations(s, "levels")
    old = _simple_bound(s, modes)
    unit = (old if old > 0 else 1e-6) / float(resolution)

    def q(t: float) -> int:
        return int(math.floor(t / unit))

    dur = [[q(a.time) for a in ms] for ms in modes]
    horizon = int(sum(max(d) for d in dur)) + 1
    edges = list(s.edge_bytes)
    xfer = {}
    if nd > 1:
        for (j, i), b in s.edge_bytes.items():
            xfer[(j, i)] = {(a, bb): q(s.transfer(b, a, bb)) for a in range(nd) for bb in range(nd) if a != bb}
        horizon += int(sum(max(v.values()) for v in xfer.values()))
    problem: dict[str, Any] = {
        "n": n, "nd": nd, "horizon": horizon, "caps": [int(c) for c in s.caps],
        "modes": [[[int(a.device), int(a.threads), int(dur[i][k])] for k, a in enumerate(ms)] for i, ms in enumerate(modes)],
        "occupancy": [[int(math.floor(s.occupancy[i][a.device] * 1000.0)) * dur[i][k]
                       if s.occupancy is not None and s.gpus[a.device] else 0 for k, a in enumerate(ms)]
                      for i, ms in enumerate(modes)],
        "edges": [[int(j), int(i)] for j, i in edges],
        "xfer": [[int(j), int(i), int(a), int(b), int(c)] for (j, i), v in xfer.items() for (a, b), c in v.items() if c > 0],
        "sinks": [i for i in range(n) if not s.succs[i]],
        "lower": min(horizon, int(math.floor(lower_bound / unit))) if lower_bound > 0 else 0,
        "hint": _hint(s, hint, modes, unit) if hint is not None else None,
    }
    res = (solve_isolated if solver is None else solver)(problem, time_limit_s, workers, seed)
    name = res["status"]
    bound = max(old, float(res["bound"]) * unit) if name in ("OPTIMAL", "FEASIBLE", "UNKNOWN") else old
    if name not in ("OPTIMAL", "FEASIBLE"):
        return CpSatResult(None, float("inf"), float("inf"), bound, False, name, time.perf_counter() - t0, unit)
    chosen, st, en = res["mode"], res["start"], res["end"]
    plans = incumbent_plans(graph, machine, s, [modes[i][chosen[i]] for i in range(n)], st, en)
    spans = {}
    for key, plan in plans.items():
        try:
            spans[key] = replay_plan_makespan(s, plan)
        except ExecutionError:
            spans[key] = float("inf")
    best = min(spans, key=spans.__getitem__)
    plan = Plan(plans[best].assignments, plans[best].graph_fingerprint, plans[best].machine_fingerprint, "cpsat",
                {"cp_status": name, "cp_makespan_s": float(res["objective"]) * unit, "lower_bound_s": bound,
                 "replay": best, "replays": spans, "time_limit_s": time_limit_s})
    return CpSatResult(plan, spans[best], float(res["objective"]) * unit, bound,
                       name == "OPTIMAL", name, time.perf_counter() - t0, unit,
                       {"modes": int(sum(len(x) for x in modes)), "replays": spans})


def _hint(s: SimStatic, hint: Plan, modes: list[list[Allocation]], unit: float) -> list[list[int]] | None:
    """``hint``'s simulated schedule as ``[op, mode, start]`` triples (ops whose allocation is no mode left out)."""
    try:
        st, _ = replay(s, hint)
    except (ExecutionError, PlanError):
        return None
    out = []
    for i in range(s.n):
        k = next((k for k, a in enumerate(modes[i]) if a.device == st.device[i] and a.threads == st.threads[i]),
                 None)
        if k is not None:
            out.append([i, k, int(math.floor(st.start_time[i] / unit))])
    return out


def incumbent_plans(graph: OpGraph, machine: Machine, s: SimStatic, chosen: Sequence[Allocation],
                    starts: Sequence[float], ends: Sequence[float]) -> dict[str, Plan]:
    """A schedule (per op an allocation, a start and an end) as Plans the
    simulator replays: ``order`` dispatches by start time (priorities only);
    ``holds`` also makes each op wait for the op on its device whose end
    freed its slots (the latest end at or before its start), so greedy
    dispatch cannot start it earlier than the schedule did."""
    n = s.n
    order = sorted(range(n), key=lambda i: (starts[i], ends[i], i))
    prio = [0.0] * n
    for r, i in enumerate(order):
        prio[i] = float(n - r)
    ids = s.op_ids
    gfp, mfp = cached_fingerprint(graph), plan_fingerprint(machine)
    base = {ids[i]: Assignment(s.dev_ids[chosen[i].device], chosen[i].threads, prio[i]) for i in range(n)}
    out = {"order": Plan(base, gfp, mfp, "cpsat")}
    preds = [set(p) for p in s.preds]
    by_dev: dict[int, list[int]] = {}
    for i in order:
        by_dev.setdefault(chosen[i].device, []).append(i)
    after: dict[int, tuple[str, ...]] = {}
    for i in range(n):
        mine = [j for j in by_dev[chosen[i].device]
                if j != i and ends[j] <= starts[i] and (ends[j] < ends[i] or prio[j] > prio[i])]
        if not mine:
            continue
        last = max(ends[j] for j in mine)
        j = max((j for j in mine if ends[j] == last), key=lambda j: prio[j])
        if j not in preds[i]:
            after[i] = (ids[j],)
    if after:
        held = {}
        for i in range(n):
            a = base[ids[i]]
            held[ids[i]] = Assignment(a.device, a.threads, a.priority, after.get(i, ()))
        plan = Plan(held, gfp, mfp, "cpsat")
        try:
            plan.validate(graph, machine, check_fingerprints=False)
            out["holds"] = plan
        except PlanError:
            pass
    return out


__all__ = ["LP_SAFETY", "THREAD_COUNTS", "Allocation", "AllocationLP", "CpSatResult", "CpSatServer", "allocation_lp",
           "allocation_lp_bound", "allocations", "cpsat_schedule", "incumbent_plans", "require_ortools"]
