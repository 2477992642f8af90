"""The discrete-event simulator: executes a Plan on a Machine with a performance model.

One engine, :class:`SimState`, serves both plan replay (:func:`replay`, behind
``opsched.backends.sim.SimBackend``, which dispatches a whole Plan by its priorities) and the Gymnasium environment
(whose agent starts ops one decision at a time), so an episode recorded as a
Plan replays *exactly* here.

What is simulated (and why it is enough for scheduling decisions):

* **Slots.**  A device has ``cores`` slots (CPU cores, GPU streams).  An op
  holds ``threads`` slots from the moment it is dispatched until it ends.
* **Transfers.**  An input written on another device must first cross the
  link: the op's compute begins at ``max(end(p) + transfer(bytes, dev(p),
  dev(op)))`` over its producers ``p`` on other devices (the model's
  ``transfer_time``: latency + bytes / bandwidth).  The op holds its slots
  while it waits, as a stream or an executor thread blocked in a copy does.
  The Trace's ``start`` is the compute start; ``meta["transfer_wait"]`` lists
  the ops that waited and for how long.
* **Interference.**  Ops computing on one device at once slow each other down
  by the model's ``slowdown(device, demands)`` (factors >= 1, from each op's
  memory-bandwidth demand when alone).  Durations are therefore progress
  based: each op carries its remaining *work* (seconds it would still need
  alone) and runs at rate ``1 / slowdown``; the rates of a device are
  recomputed whenever the set of ops computing on it changes, and the finish
  times follow.  An op alone on its device always runs at rate 1.  On a GPU,
  kernels on concurrent streams also share the compute units: each op fills
  a share of the device (``model.occupancy(op, device)``: big GEMMs nearly
  all of it, small kernels little), and while the shares of the ops
  computing there add up to more than 1 none runs faster than ``1 / sum``.
* **Runtime costs.**  The model's runtime model (``model.runtime``, a
  :class:`~opsched.engine.contracts.RuntimeModel` fitted per real backend;
  ``None`` prices the ops alone) says what a real runtime adds when ops run
  together (``corun_slowdown``, called with each op's alone time, e.g. the
  interpreter lock), what waking an idle OpenMP team costs
  (``thread_switch_s``: added to a multi-threaded CPU op that enters a
  parallel region (``opens_parallel_region(op)``) when the last op started on
  its device did not use a team of that size - a one-thread op runs no
  parallel region, so the team's helpers went idle), and a multi-threaded
  op's cost once several executor threads hold OpenMP teams
  (``team_overhead_s``: when a first pass shows two multi-threaded ops running
  at once (:func:`second_team_time` follows the runtime's executors), every
  multi-threaded CPU op that enters a parallel region from then on takes
  ``max(t(k), t(1)) + team_overhead_s`` - the process then has more OpenMP
  threads than cores and libgomp stops spin-waiting - until the run ends,
  when the runtime retires the worker that opened the second team).
* **Hand-offs.**  A runtime model with ``handoff_s > 0``
  also follows the runtime's threads (``backends/executor.py``): the calling
  thread runs every multi-threaded CPU op (one at a time; a second one at
  once goes to a worker), workers run one-thread ops, and the thread that
  finishes an op dispatches what becomes ready, keeping the first op that is
  its own to run (and a chain's only ready op of its size).  Every other
  started op is handed to a sleeping thread, which must be woken: its compute
  starts ``handoff_s`` after its dispatch (slots held meanwhile; listed in the
  trace's ``meta["handoff_wait"]``).  A run whose last op ends on a worker
  wakes the calling thread once more: ``meta["wake_end_s"]``.  A model
  without the field pays nothing for it (the common path checks one flag).
* **OpenMP spin.**  A runtime model with ``spin_s > 0``
  keeps cores busy after multi-threaded ops: when a ``k``-thread CPU op that
  entered a parallel region ends, its team's ``k - 1`` helper threads keep
  spin-waiting for the next region (libgomp's ``GOMP_SPINCOUNT``) for
  ``spin_s``, or until a multi-threaded op enters a parallel region on that
  device again.  Meanwhile the ops computing there share the device's other
  ``cores - (k - 1)`` cores: when their threads (one for an op that runs no
  parallel region) outnumber them, each runs at ``free / threads`` of its
  speed (on 2 cores: two one-thread ops right after a 2-thread op take turns
  on one core; one alone runs at full speed).  Why cores and not slots: the
  runtime runs such plans' workers unpinned and the kernel places them on
  whatever core is not spinning.  Not when the run is priced with several
  OpenMP teams (``omp_throttled``: libgomp then stops spinning, from the second team on).  A model
  without the field pays nothing for it (one flag per op start and end).
* **Busy cores.**  A CPU whose ``busy_cores`` are taken by other work (the
  machine's load) shares its cores between the plan's threads and that load:
  while the threads computing there (a team's ``threads``, one for an op
  without a parallel region) and the busy cores together outnumber the
  cores, a one-thread op runs at ``cores / (threads + busy)`` of its speed
  (the scheduler's fair share) and a team at ``1 / ceil((threads + busy) /
  cores)`` (its slowest thread shares a core, and the team waits for it at
  every barrier).  An idle machine (the default) pays nothing for it.
* **Noise.**  Optional: every op's alone time is multiplied by a lognormal
  factor ``exp(N(0, noise))`` drawn from a seeded generator.
* **Memory.**  Bytes of live tensors per device (an output lives on its
  producer's device until its last consumer finishes; a graph output until
  the end; a copied input on the consumer's device while the consumer runs).
  Reported, not enforced.

Dispatch follows ``opsched.plan``'s execution semantics exactly: an op is
ready when its producers and its ``after`` ops are done; at each event the
ready ops are taken by descending priority (ties: graph order) and each one
whose device has enough free slots starts.  Devices are independent
resources, so the greedy pass runs per device.

Speed: all per-graph quantities (the time table, demands, adjacency) are
prepared once per (graph, machine, model) and cached; the event loop works on
Python lists and a heap (numpy scalar access costs more than list indexing at
this granularity), and nothing in it scans the whole graph.  Planners and
local search, which read nothing of a replay but its makespan, call
:func:`replay_makespan`: where the run has nothing but the analytic law to
price (no runtime model; busy cores included) it takes the loop of
:mod:`opsched.engine.fast_replay`, the same event loop over arrays with no
trace, memory or core bookkeeping, compiled by numba, whose makespan is this
loop's bit for bit (a 200-op replay in 80-150 us instead of 1.5-1.8 ms;
planning 0.42-0.55x as long on 25-40-op graphs, whose default search is
mostly replays, and 0.73-0.86x on 200-op graphs; ``python
bench/replay_speed.py``, docs/bench/replay_speed.md).  Without numba it
takes this loop.
"""

from __future__ import annotations

import heapq
import math
import weakref
from bisect import insort
from collections.abc import Sequence
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel, TimeTable
from opsched.engine.fast_replay import available as fast_available
from opsched.engine.fast_replay import corun_rates, fast_makespan, fast_slot_makespan
from opsched.engine.fast_replay import supports as supports_fast
from opsched.engine.models.analytic import AnalyticModel
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace, TraceEvent

WAITING, READY, RUNNING, DONE = 0, 1, 2, 3

_DEFAULT_MODEL = AnalyticModel()


def default_perf_model() -> PerfModel:
    """The analytic model every planner falls back to (one shared instance, so
    the simulator's per-model caches are shared too)."""
    return _DEFAULT_MODEL


# --------------------------------------------------------------- caching
_FP_CACHE: dict[int, tuple[Any, str]] = {}


def cached_fingerprint(obj: OpGraph | Machine) -> str:
    """``obj.fingerprint()`` computed once per object (graphs and machines are
    immutable; a 200-op graph's fingerprint costs milliseconds, which would
    dominate a simulated run)."""
    key = id(obj)
    hit = _FP_CACHE.get(key)
    if hit is not None and hit[0]() is obj:
        return hit[1]
    fp = obj.fingerprint()
    _FP_CACHE[key] = (weakref.ref(obj), fp)
    weakref.finalize(obj, _FP_CACHE.pop, key, None)
    return fp


def plan_fingerprint(machine: Machine) -> str:
    """The machine fingerprint plans record and are checked against (its hardware, without the
    load: :meth:`opsched.machine.Machine.hardware_fingerprint`), cached like :func:`cached_fingerprint`."""
    return cached_fingerprint(machine) if not machine.loaded else cached_fingerprint(_at_rest(machine))


_AT_REST: dict[int, tuple[Any, Machine]] = {}


def _at_rest(machine: Machine) -> Machine:
    hit = _AT_REST.get(id(machine))
    if hit is not None and hit[0]() is machine:
        return hit[1]
    rest = machine.at_rest()
    _AT_REST[id(machine)] = (weakref.ref(machine), rest)
    weakref.finalize(machine, _AT_REST.pop, id(machine), None)
    return rest


class SimStatic:
    """Everything about one (graph, machine, model) the event loop needs, as lists.

    Build with :func:`prepare` (cached) or directly with a precomputed
    ``table`` (the environment's coarsened graphs sum their members' times).
    """

    def __init__(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None,
                 table: TimeTable | None = None) -> None:
        model = _DEFAULT_MODEL if model is None else model
        self.graph, self.machine, self.model = graph, machine, model
        self.table = table if table is not None else model.time_table(graph, machine)
        self._model_times = table is None  # False: a given table (e.g. summed over coarse groups)
        if self.table.device_ids != tuple(d.id for d in machine.devices):
            raise PlanError(f"time table devices {self.table.device_ids} do not match machine "
                            f"{machine.name!r} ({', '.join(d.id for d in machine.devices)})")
        n, n_dev = len(graph.ops), len(machine.devices)
        if self.table.times.shape[:2] != (n, n_dev):
            raise PlanError(f"time table has shape {self.table.times.shape}, graph {graph.name!r} on "
                            f"{machine.name!r} needs ({n}, {n_dev}, levels)")
        self.n, self.n_dev = n, n_dev
        self.devices = machine.devices
        self.dev_ids = tuple(d.id for d in machine.devices)
        self.caps = [d.cores for d in machine.devices]
        self.levels = self.table.levels
        self.level_index = self.table.level_index
        self.times = self.table.times.tolist()  # [i][d][l]
        nbytes = np.array([op.bytes_total for op in graph.ops], dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            dem = nbytes[:, None, None] / self.table.times / 1e9
        self.demands = np.nan_to_num(dem, nan=0.0, posinf=0.0).tolist()  # GB/s when alone
        self.preds = graph.pred_index
        self.succs = graph.succ_index
        self.edge_bytes = graph.edge_bytes
        self.out_bytes = [float(op.bytes_written) for op in graph.ops]
        self.op_ids = [op.id for op in graph.ops]
        # AnalyticModel's interference law is inlined in the event loop (same
        # formula, no numpy call per event); any other model is called.
        self.inline_slowdown = type(model).slowdown is AnalyticModel.slowdown
        # What a real runtime adds (see "Runtime costs", "Hand-offs", "OpenMP spin"); None: nothing.
        runtime = model.runtime
        self.runtime = runtime
        self.switch_s = float(runtime.thread_switch_s) if runtime is not None else 0.0
        self.team_s = float(runtime.team_overhead_s) if runtime is not None else 0.0
        self.handoff_s = float(runtime.handoff_s) if runtime is not None else 0.0
        self.spin_s = float(runtime.spin_s) if runtime is not None else 0.0
        opens = runtime.opens_parallel_region if runtime is not None and (
            self.team_s > 0.0 or self.switch_s > 0.0 or self.spin_s > 0.0) else None
        self.parallel = [bool(opens(op)) if opens is not None else True for op in graph.ops]
        self.bandwidth = [d.mem_bandwidth_gbs for d in machine.devices]
        self.busy = [float(d.busy_cores) for d in machine.devices]  # see "Busy cores"
        # GPU compute shares (see "Interference"): per op, per device; all 0 on CPU-only machines
        self.gpus = [d.is_gpu for d in machine.devices]
        self.occupancy = ([[float(model.occupancy(op, dev)) if dev.is_gpu else 0.0 for dev in machine.devices]
                           for op in graph.ops] if any(self.gpus) else None)
        self._xfer: dict[tuple[float, int, int], float] = {}
        self._extra_time: dict[tuple[int, int, int], tuple[float, float]] = {}

    def transfer(self, nbytes: float, src: int, dst: int) -> float:
        key = (nbytes, src, dst)
        t = self._xfer.get(key)
        if t is None:
            t = float(self.model.transfer_time(nbytes, self.dev_ids[src], self.dev_ids[dst], self.machine))
            self._xfer[key] = t
        return t

    def time_and_demand(self, i: int, d: int, threads: int) -> tuple[float, float]:
        """(alone seconds, alone GB/s) of op ``i`` on device ``d`` with ``threads``."""
        lv = self.level_index[d].get(threads)
        if lv is not None:
            return self.times[i][d][lv], self.demands[i][d][lv]
        key = (i, d, threads)
        hit = self._extra_time.get(key)
        if hit is None:  # a thread count between the levels: ask the model
            if not self._model_times:
                raise PlanError(f"no time for op {self.op_ids[i]!r} at {threads} threads on {self.dev_ids[d]}")
            op = self.graph.ops[i]
            t = float(self.model.op_time(op, self.devices[d], threads))
            hit = (t, op.bytes_total / t / 1e9 if t > 0 else 0.0)
            self._extra_time[key] = hit
        return hit

    def slowdown(self, d: int, demands: list[float]) -> list[float]:
        """Per-op slowdown factors (>= 1) of ops co-running on device ``d``."""
        if self.inline_slowdown:
            tot = sum(demands)
            bw = self.bandwidth[d]
            if tot <= bw or tot <= 0:
                return [1.0] * len(demands)
            over = tot / bw - 1.0
            return [1.0 + min(max(x / bw, 0.0), 1.0) * over for x in demands]
        f = np.asarray(self.model.slowdown(self.devices[d], np.asarray(demands, dtype=float)), dtype=float)
        return np.maximum(f, 1.0).tolist()  # co-running never speeds an op up

    def slowdown_timed(self, d: int, demands: list[float], times: list[float]) -> list[float]:
        """:meth:`slowdown` plus what the runtime model adds to co-running ops
        (``times``: each op's alone seconds)."""
        factors = self.slowdown(d, demands)
        if self.runtime is None:
            return factors
        return [f if f > 1.0 else 1.0 for f in self.runtime.corun_slowdown(self.devices[d], factors, times)]


_STATIC_CACHE = IdentityLRU(128)


def prepare(graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> SimStatic:
    """The cached :class:`SimStatic` of (graph, machine, model): the time table
    is computed once per triple (keyed by identity; the cache holds the objects
    so identities stay valid, least recently used dropped beyond 128)."""
    model = _DEFAULT_MODEL if model is None else model
    return _STATIC_CACHE.get_or_make((id(graph), id(machine), id(model)), lambda: SimStatic(graph, machine, model),
                                     graph, machine, model)


# ---------------------------------------------------------------- engine
class SimState:
    """The simulator's state, advanced event by event.

    Ops are graph indices, devices indices into ``machine.devices``.  The
    caller starts ready ops (:meth:`start`) and calls :meth:`advance` to move
    to the next completion time; rates of co-running ops are recomputed
    lazily, at the next :meth:`advance`, so the result does not depend on how
    many ops were started between two advances, only on which.

    ``after[i]``: extra op indices that must finish before ``i`` is ready (a
    Plan's control dependencies).  ``noise[i]``: a factor on op ``i``'s alone
    time (default 1).  ``throttled_from``: from this time on, price multi-threaded
    ops as a real runtime with several OpenMP teams runs them (the model's
    ``team_overhead_s``; None: never).
    """

    def __init__(self, static: SimStatic, after: Sequence[Sequence[int]] | None = None,
                 noise: Sequence[float] | None = None, throttled_from: float | None = None) -> None:
        s = static
        n, nd = s.n, s.n_dev
        self.static = s
        self.now = 0.0
        self.status = [WAITING] * n
        self.device = [-1] * n
        self.threads = [0] * n
        self.dispatch_time = [math.nan] * n
        self.start_time = [math.nan] * n  # compute start (after transfers)
        self.end_time = [math.nan] * n
        self.ready_time = [0.0] * n
        self.cores: list[tuple[int, ...] | None] = [None] * n
        self.free = list(s.caps)
        self.mem_bytes = [0.0] * nd
        #: per device, the most bytes of live outputs at any instant (co-running keeps more alive)
        self.peak_bytes = [0.0] * nd
        self.n_done = 0
        self.newly_ready: list[int] = []
        self._slots = [list(range(c)) for c in s.caps]
        self._computing: list[list[int]] = [[] for _ in range(nd)]
        self._dirty: set[int] = set()  # devices whose co-runner set changed
        self._work = [0.0] * n
        self._last = [0.0] * n
        self._rate = [0.0] * n
        self._ver = [0] * n
        self._arrive = [0.0] * n
        self._demand = [0.0] * n
        self._alone = [0.0] * n
        # per device, the size of the OpenMP team the last op used (1: none, its helpers idle;
        # 0: not yet created); kept only when waking a team costs
        self._last_threads: list[int] | None = [0] * nd if static.switch_s > 0.0 else None
        #: when a second OpenMP team opens (None: not in this run); priced from the first op started then
        self._throttled_from = throttled_from
        self._throttled = False
        # one test per op start
        self._runtime_costs = self._last_threads is not None or (throttled_from is not None and static.team_s > 0.0)
        # hand-offs between a real runtime's threads (see the module docstring); off without handoff_s
        self._handoff = static.handoff_s if static.handoff_s > 0.0 else 0.0
        if self._handoff:
            self._on_caller = [False] * n  # op i runs (ran) on the calling thread
            self._caller_busy = False
            # threads that just finished an op and may keep one they dispatch:
            # (is the calling thread, threads of the op it finished); at t=0 the caller dispatches
            self._keepers: list[tuple[bool, int]] = [(True, 0)]
            self.handoff_wait = [0.0] * n
        self.wake_end = 0.0
        # OpenMP helpers spinning after a parallel region (see the module docstring); off without spin_s,
        # and with several teams (libgomp stops spinning then).  Per device: cores spinning, until when.
        self._spin = static.spin_s if static.spin_s > 0.0 and throttled_from != 0.0 else 0.0
        if self._spin:
            self._spin_cores = [0] * nd
            self._spin_until = [0.0] * nd
        if throttled_from == 0.0:
            self._throttled, self._throttled_from = static.team_s > 0.0, None
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._running: set[int] = set()
        self._consumers_left = [len(x) for x in s.succs]
        self._noise = list(noise) if noise is not None else None
        if self._noise is not None and len(self._noise) != n:
            raise PlanError(f"noise has {len(self._noise)} factors for {n} ops")
        if after is not None and any(after):
            succ = [list(x) for x in s.succs]
            pending = [len(p) for p in s.preds]
            for i, deps in enumerate(after):
                for j in set(deps).difference(s.preds[i]):
                    if j == i:
                        continue
                    succ[j].append(i)
                    pending[i] += 1
            self._succ = succ
            self._pending = pending
        else:
            self._succ = s.succs
            self._pending = [len(p) for p in s.preds]
        self._ready: set[int] = set()
        for i in range(n):
            if self._pending[i] == 0:
                self.status[i] = READY
                self._ready.add(i)
                self.newly_ready.append(i)

    # ------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        return self.n_done == self.static.n

    @property
    def makespan(self) -> float:
        """The time the last op ended (the current time once :attr:`done`)."""
        return self.now if self.done else math.nan

    def ready_ops(self) -> list[int]:
        """Ready ops (inputs and ``after`` ops done, not started), ascending."""
        return sorted(self._ready)

    def running_ops(self) -> list[int]:
        """Started, unfinished ops (including those waiting for a transfer), ascending."""
        return sorted(self._running)

    @property
    def n_ready(self) -> int:
        return len(self._ready)

    @property
    def running(self) -> set[int]:
        """The started, unfinished ops (the state's own set: read, do not modify)."""
        return self._running

    @property
    def n_running(self) -> int:
        return len(self._running)

    def free_slots(self, device: int) -> int:
        return self.free[device]

    def mem_in_use(self, device: int) -> float:
        """Bytes of live tensors on ``device`` now."""
        return self.mem_bytes[device]

    def remaining(self, op: int) -> float:
        """Predicted seconds until running op ``op`` ends at the current rates
        (transfer wait included; a just-started op counts at rate 1)."""
        work = self._work[op]
        rate = self._rate[op]
        if rate > 0.0:
            left = max(work - (self.now - self._last[op]) * rate, 0.0) / rate
        else:
            left = work
        return left + max(self._arrive[op] - self.now, 0.0)

    def why_not(self, op: int, device: int, threads: int) -> str | None:
        """Why ``op`` cannot start on ``device`` with ``threads`` now, or None."""
        s = self.static
        if not 0 <= op < s.n:
            return f"op index {op} is outside 0..{s.n - 1}"
        st = self.status[op]
        if st != READY:
            why = {WAITING: "is still waiting for its inputs", RUNNING: "is already running", DONE: "is done"}
            return f"op {s.op_ids[op]!r} {why[st]}"
        if not 0 <= device < s.n_dev:
            return f"device index {device} is outside 0..{s.n_dev - 1}"
        dev = s.devices[device]
        if not isinstance(threads, (int, np.integer)) or threads < 1 or threads > dev.cores:
            return f"{threads!r} threads on {dev.id} (it has {dev.cores} slots)"
        if dev.is_gpu and threads != 1:
            return f"an op on {dev.id} takes exactly 1 stream slot, not {threads}"
        if self.free[device] < threads:
            return f"{dev.id} has {self.free[device]} free slots, op {s.op_ids[op]!r} asks for {threads}"
        return None

    def can_start(self, op: int, device: int, threads: int) -> bool:
        return self.why_not(op, device, threads) is None

    # ------------------------------------------------------------ actions
    def start(self, op: int, device: int, threads: int) -> None:
        """Start ready ``op`` on ``device`` with ``threads`` slots now."""
        why = self.why_not(op, device, threads)
        if why is not None:
            raise PlanError(f"cannot start at t={self.now:.6g}s: {why}")
        self.start_unchecked(op, device, int(threads))

    def start_unchecked(self, i: int, d: int, k: int) -> None:
        """Start ready op ``i`` on device ``d`` with ``k`` slots now, without
        :meth:`why_not` (the caller has checked: the hot path of planners)."""
        s = self.static
        now = self.now
        if self._throttled_from is not None and now >= self._throttled_from:
            self._second_team()
        if self._handoff:
            self._chain = len(self._ready) == 1  # op i is the only ready op (the runtime's chain case)
        self._ready.discard(i)
        self._running.add(i)
        self.status[i] = RUNNING
        self.device[i] = d
        self.threads[i] = k
        self.dispatch_time[i] = now
        self.free[d] -= k
        slots = self._slots[d]
        self.cores[i] = tuple(slots[:k])
        del slots[:k]
        mem = self.mem_bytes
        mem[d] += s.out_bytes[i]
        if mem[d] > self.peak_bytes[d]:
            self.peak_bytes[d] = mem[d]
        arrive = now
        device = self.device
        for p in s.preds[i]:
            dp = device[p]
            if dp != d:
                b = s.edge_bytes[(p, i)]
                t = self.end_time[p] + s.transfer(b, dp, d)
                if t > arrive:
                    arrive = t
                mem[d] += b
        if self._handoff and not s.devices[d].is_gpu:
            t = self._hand_off(i, k)
            if t > arrive:
                arrive = t
        t_alone, demand = s.time_and_demand(i, d, k)
        if self._noise is not None:
            t_alone *= self._noise[i]
        if self._runtime_costs:
            t_alone = self._runtime_time(i, d, k, t_alone)
        self._work[i] = t_alone
        self._alone[i] = t_alone
        self._demand[i] = demand
        self._arrive[i] = arrive
        if arrive > now:
            self._seq += 1
            heapq.heappush(self._heap, (arrive, self._seq, i, -1))
        else:
            self._begin(i)

    def _second_team(self) -> None:
        """A second OpenMP team opens now: multi-threaded ops started from here on are
        throttled, and libgomp stops spinning (the spinning helpers go to sleep)."""
        self._throttled_from = None
        self._throttled = self.static.team_s > 0.0
        if self._spin:
            self._spin = 0.0
            for d, c in enumerate(self._spin_cores):
                if c:
                    self._spin_cores[d] = 0
                    self._dirty.add(d)

    def _hand_off(self, i: int, k: int) -> float:
        """When CPU op ``i`` (``k`` threads), dispatched now, starts computing
        as far as the runtime's threads go (see "Hand-offs" in the module
        docstring): now when a thread that just finished an op keeps it, else
        after waking the thread it is handed to."""
        caller = k > 1 and not self._caller_busy
        keepers = self._keepers
        hit = -1
        if self._chain:  # the only ready op, of the finished op's size: that thread goes on with it
            for j, (kc, kk) in enumerate(keepers):
                if kk == k:
                    hit, caller = j, kc
                    break
        if hit < 0:
            for j, (kc, _) in enumerate(keepers):
                if kc == caller:
                    hit = j
                    break
        if caller:
            self._caller_busy = True
        self._on_caller[i] = caller
        if hit >= 0:
            del keepers[hit]
            return self.now
        self.handoff_wait[i] = self._handoff
        return self.now + self._handoff

    def _runtime_time(self, i: int, d: int, k: int, t_alone: float) -> float:
        """``t_alone`` plus a real runtime's thread-switch and OpenMP-team costs
        (see the module docstring); called only when the model prices them."""
        s = self.static
        if self._throttled and k > 1 and s.parallel[i] and not s.devices[d].is_gpu:
            # no longer faster than one thread, plus waking the sleeping team
            t1 = s.time_and_demand(i, d, 1)[0] * (self._noise[i] if self._noise is not None else 1.0)
            t_alone = max(t_alone, t1) + s.team_s
        last_threads = self._last_threads
        if last_threads is not None and not s.devices[d].is_gpu:
            if k == 1:
                last_threads[d] = 1  # no parallel region: the team's helpers go idle
            elif s.parallel[i]:
                if last_threads[d] != k:
                    t_alone += s.switch_s  # wake (or resize) the team
                last_threads[d] = k
        return t_alone

    def _begin(self, i: int) -> None:
        """Op ``i``'s data is on its device: it starts computing."""
        self.start_time[i] = self.now
        self._last[i] = self.now
        self._rate[i] = 0.0
        d = self.device[i]
        self._computing[d].append(i)
        self._dirty.add(d)
        if self._spin and self._spin_cores[d] and self.threads[i] > 1 and self.static.parallel[i]:
            self._spin_cores[d] = 0  # the next parallel region: the helpers have work again

    def _flush(self) -> None:
        """Recompute the rates (and finish times) on devices whose co-runners changed.

        The hot loop of a co-running simulation (every change on a device
        re-rates all its ops), hence the local variables and the inlined
        analytic slowdown."""
        dirty = self._dirty
        if not dirty:
            return
        s = self.static
        now = self.now
        work, last, rate, ver, demand = self._work, self._last, self._rate, self._ver, self._demand
        heap = self._heap
        push = heapq.heappush
        seq = self._seq
        for d in sorted(dirty) if len(dirty) > 1 else dirty:
            ops = self._computing[d]
            if not ops:
                continue
            alone = len(ops) == 1
            if alone or (s.inline_slowdown and sum(demand[i] for i in ops) <= s.bandwidth[d]):
                # no co-run slowdown: every rate is 1 (the common case); ops already at rate 1 keep their events
                if not ((s.occupancy is not None and s.gpus[d]) or (self._spin and self._spin_cores[d])
                        or s.busy[d]):
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
            elif s.inline_slowdown:
                dem = [demand[i] for i in ops]
                rates = corun_rates(dem, sum(dem), s.bandwidth[d])  # AnalyticModel.slowdown, without numpy
            elif s.runtime is not None:
                alone = self._alone
                rates = [1.0 / f for f in s.slowdown_timed(d, [demand[i] for i in ops], [alone[i] for i in ops])]
            else:
                rates = [1.0 / f for f in s.slowdown(d, [demand[i] for i in ops])]
            if s.occupancy is not None and s.gpus[d]:
                share = sum(s.occupancy[i][d] for i in ops)
                if share > 1.0:  # the kernels' blocks no longer fit side by side: they share the GPU
                    cap = 1.0 / share
                    rates = [r if r < cap else cap for r in rates]
            if self._spin and self._spin_cores[d]:
                rates = self._spin_share(d, ops, rates)
            if s.busy[d]:
                rates = self._busy_share(d, ops, rates)
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
        self._seq = seq
        dirty.clear()

    def advance(self) -> list[int]:
        """Move time to the next completion; complete every op that ends then
        (and start computing those whose transfers arrive on the way).  Returns
        the completed ops in completion order; ``newly_ready`` gains the ops
        that became ready."""
        self._flush()
        if self._handoff:
            self._keepers.clear()  # threads that kept nothing went back to sleep
        heap, ver = self._heap, self._ver
        completed: list[int] = []
        pop = heapq.heappop
        while True:
            while heap:
                top = heap[0]
                v = top[3]
                if v < 0 or v == ver[top[2]]:
                    break
                pop(heap)  # a finish time superseded by a rate change
            if not heap:
                if completed:
                    return completed
                raise ExecutionError(
                    f"simulation stalled at t={self.now:.6g}s: nothing is running and "
                    f"{self.static.n - self.n_done} op(s) are not done (ready: {len(self._ready)})")
            t = heap[0][0]
            if completed and t > self.now:
                return completed
            if t > self.now:
                self.now = t
            while heap and heap[0][0] <= t:
                _, _, i, v = pop(heap)
                if v == -1:
                    self._begin(i)
                elif v == -2:  # a spin window may end (i: the device)
                    self._spin_end(i)
                elif v == ver[i]:
                    self._complete(i)
                    completed.append(i)
            self._flush()

    def _spin_share(self, d: int, ops: list[int], rates: Sequence[float]) -> list[float]:
        """``rates`` of the ops computing on ``d`` while OpenMP helpers spin there:
        their threads share the cores that do not spin (see "OpenMP spin")."""
        s = self.static
        free = s.caps[d] - self._spin_cores[d]
        threads, parallel = self.threads, s.parallel
        want = sum(threads[i] if parallel[i] else 1 for i in ops)
        if want <= free:
            return list(rates)
        share = free / want
        return [r * share for r in rates]

    def _busy_share(self, d: int, ops: list[int], rates: Sequence[float]) -> list[float]:
        """``rates`` of the ops computing on ``d`` while other work keeps
        ``busy_cores`` of it busy (see "Busy cores")."""
        s = self.static
        threads, parallel = self.threads, s.parallel
        want = sum(threads[i] if parallel[i] else 1 for i in ops) + s.busy[d]
        cores = s.caps[d]
        if want <= cores:
            return list(rates)
        fair = cores / want
        team = 1.0 / math.ceil(want / cores)
        return [r * (team if threads[i] > 1 and parallel[i] else fair) for i, r in zip(ops, rates, strict=True)]

    def _spin_end(self, d: int) -> None:
        """A spin window's end event: the helpers go to sleep unless a later
        region restarted the window (then a later event ends it)."""
        if self._spin_cores[d] and self.now >= self._spin_until[d]:
            self._spin_cores[d] = 0
            self._dirty.add(d)

    def _complete(self, i: int) -> None:
        s = self.static
        now = self.now
        self.status[i] = DONE
        self.end_time[i] = now
        self.n_done += 1
        self._running.discard(i)
        d = self.device[i]
        if self._handoff and not s.devices[d].is_gpu:
            on_caller = self._on_caller[i]
            if on_caller:
                self._caller_busy = False
            self._keepers.append((on_caller, self.threads[i]))
            if self.n_done == s.n and not on_caller:
                self.wake_end = self._handoff  # the calling thread sleeps until the run is over

        if self._spin and self.threads[i] > 1 and s.parallel[i] and not s.devices[d].is_gpu:
            # the team's helpers spin on k - 1 cores for spin_s (see "OpenMP spin")
            self._spin_cores[d] = self.threads[i] - 1
            self._spin_until[d] = until = now + self._spin
            self._seq += 1
            heapq.heappush(self._heap, (until, self._seq, d, -2))

        self.free[d] += self.threads[i]
        slots = self._slots[d]
        cores = self.cores[i]
        assert cores is not None  # set when op i started (start_unchecked)
        slots.extend(cores)
        slots.sort()
        self._computing[d].remove(i)
        self._dirty.add(d)
        mem = self.mem_bytes
        device = self.device
        cl = self._consumers_left
        for p in s.preds[i]:
            dp = device[p]
            if dp != d:
                mem[d] -= s.edge_bytes[(p, i)]
            cl[p] -= 1
            if cl[p] == 0:
                mem[dp] -= s.out_bytes[p]
        pending = self._pending
        for j in self._succ[i]:
            pending[j] -= 1
            if pending[j] == 0:
                self.status[j] = READY
                self._ready.add(j)
                self.ready_time[j] = now
                self.newly_ready.append(j)

    # -------------------------------------------------------------- output
    def trace(self, backend: str = "sim", op_ids: Sequence[str] | None = None, **meta: Any) -> Trace:
        """The Trace of the finished (or partial) run: ops that have started."""
        s = self.static
        ids = s.op_ids if op_ids is None else op_ids
        events = []
        waits = {}
        handoffs: dict[str, float] = {}
        for i in sorted(self._running.union(j for j in range(s.n) if self.status[j] == DONE),
                        key=lambda j: (self.dispatch_time[j], j)):
            d = self.device[i]
            start = self.start_time[i]
            if math.isnan(start):
                start = self._arrive[i]
            end = self.end_time[i]
            if math.isnan(end):
                end = self.now + self.remaining(i)
            wait = start - self.dispatch_time[i]
            if self._handoff and self.handoff_wait[i] > 0.0:
                handoffs[ids[i]] = self.handoff_wait[i]
                wait = wait - self.handoff_wait[i] if wait - self.handoff_wait[i] > 1e-12 else 0.0
            if wait > 0.0:
                waits[ids[i]] = wait
            cores = self.cores[i]
            assert cores is not None  # every started op holds its core slots
            lane = cores[0] if s.devices[d].is_gpu else None
            events.append(TraceEvent(ids[i], start, end, s.dev_ids[d], self.threads[i], cores, lane))
        if waits:
            meta["transfer_wait"] = waits
        meta["peak_bytes"] = {s.dev_ids[d]: float(b) for d, b in enumerate(self.peak_bytes) if b > 0}
        if self._handoff:
            meta["handoff_wait"] = handoffs
            meta["wake_end_s"] = self.wake_end
        return Trace(tuple(events), backend=backend, meta=meta)


# ----------------------------------------------------------- plan replay
#: An op's ``after`` list when the plan gives it none (typed: ``[()] * n`` is a list of ``tuple[()]``).
_NO_AFTER: tuple[int, ...] = ()


def replay(s: SimStatic, plan: Plan, noise: Sequence[float] | None = None) -> tuple[SimState, bool]:
    """Run ``plan`` (already validated for ``s.graph`` and ``s.machine``) to the
    end with the plan semantics' greedy dispatch; returns the finished state and
    whether the run was priced with several OpenMP teams (``omp_throttled``: from the
    moment a second one opens)."""
    return replay_lists(s, *_plan_lists(s, plan), noise)


def replay_plan_makespan(s: SimStatic, plan: Plan, noise: Sequence[float] | None = None) -> float:
    """``replay(s, plan, noise)[0].now`` (the same float), by :func:`replay_makespan`."""
    return replay_makespan(s, *_plan_lists(s, plan), noise)


def _plan_lists(s: SimStatic, plan: Plan) -> tuple[list[int], list[int], list[float], list[tuple[int, ...]] | None]:
    """``plan`` as per-op lists: device index, threads, priority, the ops it waits for (None: none anywhere)."""
    n = s.n
    asg = plan.assignments
    dev_index = s.machine.device_index
    graph = s.graph
    dev = [0] * n
    thr = [0] * n
    prio = [0.0] * n
    after: list[tuple[int, ...]] | None = None
    index = graph.index
    for i, op in enumerate(graph.ops):
        a = asg[op.id]
        dev[i] = dev_index[a.device]
        thr[i] = a.threads
        prio[i] = a.priority
        if a.after:
            if after is None:
                after = [_NO_AFTER] * n
            after[i] = tuple(index[x] for x in a.after)
    return dev, thr, prio, after


def _order(n: int, prio: Sequence[float]) -> tuple[list[int], list[int]]:
    """The dispatch order of priorities ``prio`` (descending, ties: graph order) and its inverse."""
    order = sorted(range(n), key=lambda i: (-prio[i], i))
    rank = [0] * n
    for r, i in enumerate(order):
        rank[i] = r
    return order, rank


def replay_makespan(s: SimStatic, dev: list[int], thr: list[int], prio: Sequence[float],
                    after: list[tuple[int, ...]] | None, noise: Sequence[float] | None = None) -> float:
    """The makespan of :func:`replay_lists` (the same float), without the state:
    by :func:`opsched.engine.fast_replay.fast_makespan`'s compiled loop where it
    prices the run (no runtime model, the analytic interference law; busy
    cores included) and numba is there, by the general replay elsewhere.  What planners and local search
    call, since they read nothing but the makespan."""
    if supports_fast(s) and fast_available():
        return fast_makespan(s, dev, thr, prio, after, noise)
    return float(replay_lists(s, dev, thr, prio, after, noise)[0].now)


def replay_slot_makespan(s: SimStatic, device: Sequence[int], level: Sequence[int], rank: Sequence[int],
                         after: Sequence[tuple[int, ...]]) -> float:
    """:func:`replay_makespan` of a slot plan (:class:`opsched.engine.slots.SlotPlan`:
    per op a device index, a thread-level index into ``s.levels``, a rank in the
    dispatch order, the ops it waits for): the compiled replay reads it as it is
    (:func:`opsched.engine.fast_replay.fast_slot_makespan`), the general one gets
    the per-op lists (threads, priorities ``n - rank``) it reads.  The same gate
    as :func:`replay_makespan`, so one switch turns both to the general replay."""
    if supports_fast(s) and fast_available():
        return fast_slot_makespan(s, device, level, rank, after)
    levels = s.levels
    dev = list(device)
    thr = [int(levels[d][lv]) for d, lv in zip(dev, level, strict=True)]
    prio = [float(s.n - r) for r in rank]  # the priorities a slot plan's Plan gets, without building it
    holds = [tuple(a) for a in after] if any(after) else None
    return float(replay_lists(s, dev, thr, prio, holds)[0].now)


def replay_lists(s: SimStatic, dev: list[int], thr: list[int], prio: Sequence[float],
                 after: list[tuple[int, ...]] | None, noise: Sequence[float] | None = None) -> tuple[SimState, bool]:
    """:func:`replay` of a plan given as per-op lists: device index, threads,
    priority and the ops it waits for (None: none anywhere), as a local search
    over slot plans holds them (:func:`opsched.engine.slots.makespan`), without
    building a Plan first."""
    n = s.n
    order, rank = _order(n, prio)
    st = _dispatch(s, dev, thr, order, rank, after, noise, None)
    if (s.team_s > 0.0 or s.spin_s > 0.0) and any(thr[i] > 1 and not s.devices[dev[i]].is_gpu for i in range(n)):
        t = second_team_time(st, s)
        if t is not None:  # from then on several executor threads hold OpenMP teams: priced as the runtime runs
            # them (the run is the same up to t, so the second pass prices everything started from t on)
            return _dispatch(s, dev, thr, order, rank, after, noise, t), True
    return st, False


def _dispatch(s: SimStatic, dev: list[int], thr: list[int], order: list[int], rank: list[int],
              after: list[tuple[int, ...]] | None, noise: Sequence[float] | None,
              throttled_from: float | None) -> SimState:
    """The plan semantics' greedy dispatch loop, to the end of the run."""
    st = SimState(s, after=after, noise=noise, throttled_from=throttled_from)
    queues: list[list[int]] = [[] for _ in range(s.n_dev)]
    free = st.free
    newly = st.newly_ready
    start, advance = st.start_unchecked, st.advance  # bound once: the loop runs once per event
    devices = range(s.n_dev)
    n = s.n
    while True:
        if newly:
            for i in newly:
                insort(queues[dev[i]], rank[i])
            newly.clear()
        for d in devices:
            q = queues[d]
            if not q:
                continue
            f = free[d]
            j = 0
            while f > 0 and j < len(q):
                i = order[q[j]]
                k = thr[i]
                if k <= f:
                    start(i, d, k)
                    del q[j]
                    f -= k
                else:
                    j += 1
        if st.n_done == n:
            return st
        advance()


def second_team_time(st: SimState, s: SimStatic) -> float | None:
    """When a real runtime would open a second OpenMP team in this finished
    simulation (None: never; CPU ops only: OpenMP teams are per process).

    The runtime (``backends/executor.py``) runs every multi-threaded op on the
    calling thread, with the process's one team, unless the calling thread is
    already running one: then a worker runs it and opens a team of its own,
    which lives until the run ends (the runtime then retires that worker).  So
    the second team opens at the first dispatch of a multi-threaded op that
    enters a parallel region while another one runs."""
    events: list[tuple[float, int]] = []
    for i in range(s.n):
        if st.threads[i] > 1 and s.parallel[i] and not s.devices[st.device[i]].is_gpu:
            events.append((st.dispatch_time[i], 1))
            events.append((st.end_time[i], -1))
    events.sort()  # at equal times an end (-1) sorts before a start (+1)
    now = 0
    for t, step in events:
        now += step
        if now > 1:
            return t
    return None


# ------------------------------------------------------------- simulator
class Simulator:
    """Discrete-event execution of a Plan on ``machine`` with a performance model.

    What every policy that scores plans uses (``Simulator(machine, model).makespan(graph, plan)``)
    and what :class:`opsched.backends.sim.SimBackend` presents as a backend.
    ``model`` defaults to the analytic model; a planning model
    (:class:`~opsched.engine.models.runtime.PlanningModel`) also prices what its
    real runtime adds (hand-offs, OpenMP spin and teams).  ``noise`` is the
    sigma of a lognormal factor on every op's time (0: none), drawn from
    ``numpy.random.default_rng(seed)``: a simulator built with the same seed
    reproduces the same sequence of runs; ``run(..., seed=s)`` reproduces one run.
    """

    def __init__(self, machine: Machine, model: PerfModel | None = None, noise: float = 0.0, seed: int = 0) -> None:
        if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
            raise ValueError(f"Simulator: noise must be a finite number >= 0, got {noise!r}")
        self.machine = machine
        self.model = default_perf_model() if model is None else model
        self.noise = float(noise)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def static(self, graph: OpGraph) -> SimStatic:
        return prepare(graph, self.machine, self.model)

    def validate(self, graph: OpGraph, plan: Plan) -> None:
        """Plan.validate, with the fingerprints compared through a per-object cache."""
        where = f"plan{' ' + repr(plan.policy) if plan.policy else ''} for graph {graph.name!r}"
        if plan.graph_fingerprint and plan.graph_fingerprint != cached_fingerprint(graph):
            raise PlanError(f"{where}: made for a different graph (fingerprint {plan.graph_fingerprint}, "
                            f"this graph is {cached_fingerprint(graph)})")
        if plan.machine_fingerprint and plan.machine_fingerprint != plan_fingerprint(self.machine):
            raise PlanError(f"{where}: made for a different machine (fingerprint {plan.machine_fingerprint}, "
                            f"machine {self.machine.name!r} is {plan_fingerprint(self.machine)})")
        plan.validate(graph, self.machine, check_fingerprints=False)

    def run(self, graph: OpGraph, plan: Plan, inputs: object = None, seed: int | None = None) -> Trace:
        """Simulate ``plan`` (``inputs`` are ignored: the simulator computes no values)."""
        self.validate(graph, plan)
        s = self.static(graph)
        st, throttled = replay(s, plan, self._noise(s.n, seed))
        meta = {"omp_throttled": True} if throttled else {}
        return st.trace("sim", None, model=self.model.name, noise=self.noise, policy=plan.policy, **meta)

    def _noise(self, n: int, seed: int | None) -> list[float] | None:
        """Each op's lognormal time factor for one run (None without noise)."""
        if self.noise <= 0:
            return None
        rng = self._rng if seed is None else np.random.default_rng(seed)
        return rng.lognormal(0.0, self.noise, n).tolist()

    def makespan(self, graph: OpGraph, plan: Plan, validate: bool = True) -> float:
        """Seconds ``plan`` takes on this machine under the model: ``run(graph,
        plan).makespan`` (the same value and the same noise draw) without
        building the trace, which planners that score many plans never read.
        The replay ends at its last completion, so its clock is the trace's
        last end (every start is at or after 0).  ``validate=False``: the
        caller has just validated ``plan`` for this graph and machine (a
        policy's own plans: :func:`opsched.policies.base.build_plan` does)."""
        if validate:
            self.validate(graph, plan)
        s = self.static(graph)
        return replay_plan_makespan(s, plan, self._noise(s.n, None))

    def peak_bytes(self, graph: OpGraph, plan: Plan, device: str = "cpu") -> float:
        """The most bytes of op outputs ``plan`` keeps alive at once on ``device`` (the activations
        a co-running schedule holds that a sequential one would have freed; weights not counted)."""
        return float(self.run(graph, plan).meta.get("peak_bytes", {}).get(device, 0.0))


# ----------------------------------------------------------- lower bound
def lower_bound(graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> float:
    """A makespan no schedule of ``graph`` on ``machine`` can beat (seconds).

    ``max(critical_path, work / capacity)`` where, with ``t[i, d, k]`` the
    model's alone time of op ``i`` on device ``d`` at thread level ``k`` (the
    levels of ``Device.thread_levels()``, the ones opsched's plans use):

    * ``critical_path`` is the longest path through the graph with every op
      at its fastest time ``min_{d,k} t[i, d, k]`` and no transfers;
    * ``work`` is ``sum_i min_{d,k} t[i, d, k] * k`` -- the slot-seconds each op
      occupies at its most efficient (device, level), a GPU op taking 1 slot;
    * ``capacity`` is the machine's slot count: CPU cores plus GPU streams.

    It holds for every schedule the simulator produces because transfers and
    co-run slowdowns only lengthen ops and slot-seconds, and a plan holding
    slots cannot exceed ``capacity`` slots at once.  (Plans with thread counts
    between the levels are priced at the levels' best, which for a convex
    time-vs-threads curve is still a bound in practice but not a proof.)
    """
    s = prepare(graph, machine, model)
    times = s.table.times
    if times.shape[0] == 0:
        return 0.0
    fastest = times.min(axis=(1, 2))
    slots = np.full(times.shape[1:], np.inf)
    for d, lv in enumerate(s.levels):
        slots[d, : len(lv)] = lv
    work = float((times * slots[None]).min(axis=(1, 2)).sum())
    capacity = float(sum(s.caps))
    cp = float(graph.upward_rank_array(fastest).max())
    return max(cp, work / capacity)


def sequential_makespan(graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> float:
    """All ops one after another, each with all CPU cores (no co-running, no
    transfers): the environment's per-graph reward reference."""
    s = prepare(graph, machine, model)
    cpu = machine.device_index["cpu"]
    return float(s.table.on(cpu, machine.cpu.cores).sum())
