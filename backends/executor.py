"""The compiled-plan executor behind :class:`~opsched.backends.torch_cpu.TorchCPUBackend`.

Two pieces, both framework-neutral (an op is any ``fn(values)`` callable):

:class:`CompiledPlan`
    A :class:`~opsched.plan.Plan` turned, once, into flat integer lists: each
    op's callable, thread count and dispatch rank (its position in the plan's
    priority order), a dependency counter (data predecessors plus ``after``
    ops) and a successor list, the initially ready ops, and which value slots
    may be freed when.  Running a plan then touches only lists and ints - no
    dicts of op ids, no fx interpretation - which is what keeps the runtime's
    overhead to a few microseconds per op.

:class:`WorkerPool`
    Persistent executor threads (created on demand up to the number of core
    slots, reused across runs).  Dispatch is *decentralised*: the thread that
    finishes an op updates the counters under one lock, starts every ready op
    that fits in the free slots (the plan semantics of ``opsched/plan.py``:
    descending priority, each one that fits starts at once), keeps the first
    one it may run for itself - so a chain of ops runs on one thread with no
    hand-off - and hands the others on through queues.  The only waits are a
    worker blocked on its empty queue and the caller blocked on its own; nobody
    spins.

    One OpenMP team per process: the *calling* thread runs every
    multi-threaded op itself (with the OpenMP team it already uses for eager
    PyTorch); the workers run the one-thread ops, which open no parallel
    region and so create no team.  Why: each thread that runs a
    multi-threaded op gets a team of its own, kept afterwards, and once the
    process holds more OpenMP threads than CPUs libgomp stops spin-waiting at
    its barriers - every parallel region then pays for waking sleeping helpers,
    a multi-threaded op is no faster than on one thread, and *eager* PyTorch
    in the same process slows down too (measured here on resnet50: eager
    34 ms, 61 ms after one plan had run 2-thread ops on a worker).  Only when
    two multi-threaded ops run side by side does the second go to a worker
    (a second team: unavoidable then), and that worker's thread exits when
    the run ends (a fresh one takes its place), taking its team with it: a
    team kept alive would throttle every later parallel region of the
    process - eager PyTorch, the next plans and the candidates
    ``opsched.apply`` times after this one (measured here: inception's eager
    training step 151 ms, 292 ms while a thread that had run one 2-thread
    matmul lived on, 154 ms once it exited; ``bench/omp_teams.py``).

    Pinning in plans with multi-threaded ops: after every parallel region the
    helper threads of the caller's team keep spin-waiting for the next one
    (libgomp's default ``GOMP_SPINCOUNT``, a few milliseconds here), each on a
    core of its own.  A worker pinned to that core runs its one-thread op at
    half speed meanwhile, even when another core sits idle - measured here
    (``docs/findings.md``, "mixed plans"): one-thread ops of such plans 1.3-4x slower
    than in a chain.  The helpers' CPUs are the kernel's choice and unknown
    to us, so in such plans the workers run *unpinned* (``pin_mixed=False``,
    the default) and the kernel's wake-up placement puts them on an idle core;
    plans of one-thread ops only start no team and stay pinned.  Making the
    helpers stop spinning sooner (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``) is
    possible only at process start and costs every chain of multi-threaded
    ops and eager PyTorch a wake-up per parallel region (same benchmark).

Cancellation and failure: an op that raises marks the run failed; no new op
is dispatched, running ops finish, and when the last one does the caller is
woken and raises.  A ``KeyboardInterrupt`` in the caller does the same
(``abort``), then re-raises.  Workers survive both and serve the next run.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from heapq import heappop, heappush
from time import perf_counter
from typing import Any

#: How long the caller sleeps between checks for a pending KeyboardInterrupt
#: while it waits for a run (a real SIGINT interrupts the wait at once; a
#: simulated one, ``_thread.interrupt_main()``, is noticed within this time).
_WAIT_SLICE_S = 0.1


class CompiledPlan:
    """A plan pre-resolved for fast repeated execution (see the module docstring).

    Ops are numbered as in ``graph.ops``.  ``fns[i](values)`` runs op ``i``;
    ``threads[i]`` is its thread count (= core slots it takes); ``rank[i]`` its
    position in the dispatch order (0 = highest priority, ties in graph order);
    ``ndeps[i]`` how many ops must finish first; ``succs[i]`` the ops waiting on
    it.  ``serial_order`` is set when no two ops can ever co-run (every op takes
    every slot): then the plan semantics reduce to one fixed order, computed
    here once.

    ``free_after`` / ``readers`` describe value-slot freeing: a slot no op
    reads is dropped as soon as its writer finishes; a slot read by ops is
    dropped when its last reader finishes (``readers[s]`` readers; op ``i``
    releases the slots in ``releases[i]``).  Protected slots (graph inputs,
    constants, outputs) are never dropped.
    """

    __slots__ = ("n", "op_ids", "fns", "threads", "rank", "by_rank", "ndeps", "succs", "initial_ready",
                 "slots", "serial_order", "free_after", "releases", "readers", "serial_free", "can_free")

    def __init__(self, op_ids: Sequence[str], fns: Sequence[Callable[[list], Any]], threads: Sequence[int],
                 order: Sequence[int], deps: Sequence[Iterable[int]], slots: int,
                 reads: Sequence[Sequence[int]] | None = None, writes: Sequence[Sequence[int]] | None = None,
                 protected: set[int] | None = None) -> None:
        n = len(op_ids)
        self.n = n
        self.op_ids = list(op_ids)
        self.fns = list(fns)
        self.threads = [int(t) for t in threads]
        self.slots = int(slots)
        self.by_rank = list(order)
        self.rank = [0] * n
        for r, i in enumerate(order):
            self.rank[i] = r
        dep_sets = [sorted(set(d)) for d in deps]
        self.ndeps = [len(d) for d in dep_sets]
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, d in enumerate(dep_sets):
            for j in d:
                succs[j].append(i)
        self.succs = [tuple(s) for s in succs]
        self.initial_ready = sorted(self.rank[i] for i in range(n) if self.ndeps[i] == 0)
        self.serial_order = self._static_order() if all(t >= self.slots for t in self.threads) else None
        self._plan_freeing(reads, writes, protected)

    def _static_order(self) -> list[int]:
        """The one order the plan semantics allow when ops never co-run."""
        ndeps = list(self.ndeps)
        ready = list(self.initial_ready)
        out = []
        while ready:
            i = self.by_rank[heappop(ready)]
            out.append(i)
            for s in self.succs[i]:
                ndeps[s] -= 1
                if not ndeps[s]:
                    heappush(ready, self.rank[s])
        return out

    def _plan_freeing(self, reads: Sequence[Sequence[int]] | None, writes: Sequence[Sequence[int]] | None,
                      protected: set[int] | None) -> None:
        n = self.n
        self.free_after: list[tuple[int, ...]] = [()] * n
        self.releases: list[tuple[int, ...]] = [()] * n
        self.readers: list[int] = []
        self.serial_free: list[tuple[int, ...]] = [()] * n
        self.can_free = False
        if reads is None or writes is None or protected is None:
            return
        readers_of: dict[int, list[int]] = {}
        for i, rs in enumerate(reads):
            for s in rs:
                if s not in protected:
                    readers_of.setdefault(s, []).append(i)
        free_after: list[list[int]] = [[] for _ in range(n)]
        for i, ws in enumerate(writes):
            for s in ws:
                if s not in protected and s not in readers_of:
                    free_after[i].append(s)
        self.free_after = [tuple(f) for f in free_after]
        n_slots = 1 + max([s for rs in reads for s in rs] + [s for ws in writes for s in ws], default=-1)
        self.readers = [0] * n_slots
        for s, r in readers_of.items():
            self.readers[s] = len(r)
        self.releases = [tuple(s for s in rs if s in readers_of) for rs in reads]
        self.can_free = bool(readers_of) or any(self.free_after)
        if self.serial_order is not None:
            pos = {i: k for k, i in enumerate(self.serial_order)}
            last: list[list[int]] = [[] for _ in range(n)]
            for s, rd in readers_of.items():
                last[max(rd, key=pos.__getitem__)].append(s)
            self.serial_free = [tuple(free_after[i]) + tuple(last[i]) for i in range(n)]


class OpFailure(Exception):
    """Internal: carries the failing op index and its exception out of a run."""

    def __init__(self, index: int, exc: BaseException) -> None:
        super().__init__(index, exc)
        self.index = index
        self.exc = exc


class _Run:
    """The mutable state of one run; every field below ``lock`` is guarded by the pool lock."""

    __slots__ = ("cp", "values", "ready", "ndeps", "free", "running", "n_done", "aborted", "error", "starts",
                 "ends", "cores", "lanes", "done", "rcount", "free_values", "team_q", "team_busy", "pin")

    def __init__(self, cp: CompiledPlan, values: list, free_values: bool, pin: bool = True) -> None:
        self.cp = cp
        #: Whether workers pin themselves to their slots' CPUs in this run.
        self.pin = pin
        self.values = values
        self.ready = list(cp.initial_ready)
        self.ndeps = list(cp.ndeps)
        self.free = list(range(cp.slots))
        self.running = 0
        self.n_done = 0
        self.aborted = False
        self.error: tuple[int, BaseException] | None = None
        n = cp.n
        self.starts = [0.0] * n
        self.ends = [0.0] * n
        self.cores: list[tuple[int, ...]] = [()] * n
        self.lanes = [-1] * n
        self.done = threading.Event()
        self.free_values = free_values and cp.can_free
        self.rcount = list(cp.readers) if self.free_values else None
        #: Multi-threaded ops for the calling thread (None: the run may be over).
        self.team_q: queue.SimpleQueue = queue.SimpleQueue()
        #: Whether the calling thread has a multi-threaded op (running or queued).
        self.team_busy = False


#: Lane recorded for ops run by the calling thread.
CALLER_LANE = -1


def _finish(run: _Run) -> None:
    """Mark ``run`` over and wake the calling thread."""
    run.done.set()
    run.team_q.put(None)


def _check_deadlock(run: _Run) -> None:
    """Nothing runs any more (caller holds the lock): ops never done fail the run."""
    if not run.aborted and run.n_done != run.cp.n:
        run.error = (-1, RuntimeError(f"deadlock: {run.cp.n - run.n_done} op(s) can never become ready"))
        run.aborted = True


def _give(state: _PoolState, run: _Run, task: tuple[int, tuple[int, ...]]) -> None:
    """Hand a started op on (caller holds the lock): a multi-threaded one to
    the calling thread unless it already has one, anything else to a worker."""
    if run.cp.threads[task[0]] > 1 and not run.team_busy:
        run.team_busy = True
        run.team_q.put(task)
    else:
        state.hand((run, task[0], task[1]))


def _take(free: list[int], k: int, prefer: tuple[int, ...] | None) -> tuple[int, ...]:
    """Take ``k`` free slots: ``prefer`` (the cores a worker is already pinned
    to) when it has exactly ``k`` free slots, else the lowest-numbered ones."""
    if prefer is not None and len(prefer) == k and all(c in free for c in prefer):
        for c in prefer:
            free.remove(c)
        return prefer
    if k == 1:
        return (free.pop(0),)
    got = tuple(free[:k])
    del free[:k]
    return got


def _dispatch(run: _Run, prefer: tuple[int, ...] | None = None) -> list[tuple[int, tuple[int, ...]]]:
    """Start every ready op that fits (descending priority); caller holds the lock.
    The first op started goes to the caller, so it gets the caller's ``prefer`` cores."""
    ready, free = run.ready, run.free
    cp = run.cp
    by_rank, threads = cp.by_rank, cp.threads
    started = []
    skipped = None
    while ready and free:
        r = heappop(ready)
        i = by_rank[r]
        k = threads[i]
        if k <= len(free):
            started.append((i, _take(free, k, None if started else prefer)))
        else:
            if skipped is None:
                skipped = []
            skipped.append(r)
    if skipped:
        for r in skipped:
            heappush(ready, r)
    run.running += len(started)
    return started


class _PoolState:
    """What the worker threads share (kept apart from :class:`WorkerPool` so a
    forgotten pool can be garbage-collected and its finalizer stop the workers)."""

    def __init__(self, core_map: list[int] | None, name: str,
                 set_threads: Callable[[int], None] | None, get_threads: Callable[[], int] | None,
                 thread_init: Callable[[], None] | None) -> None:
        self.lock = threading.Lock()
        self.core_map = core_map
        #: The CPUs an unpinned worker may run on (the process's affinity at start).
        self.allowed: set[int] | None = set(os.sched_getaffinity(0)) if core_map is not None else None
        self.name = name
        self.queues: list[queue.SimpleQueue] = []
        self.threads: list[threading.Thread] = []
        self.idle: list[int] = []
        self.pins: list[tuple[int, ...] | None] = []  # the cores each worker is pinned to (a hint)
        self.closed = False
        self.pin_error: str | None = None
        self.set_threads = set_threads
        self.get_threads = get_threads
        self.thread_init = thread_init
        #: Workers that ran a multi-threaded op in this run, so hold an OpenMP team of their own.
        self.teams: set[int] = set()

    def spawn(self, w: int | None = None) -> int:
        """Start one more worker, or a fresh thread for worker ``w`` (caller holds
        the lock or is the constructor)."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        new = w is None
        w = len(self.threads) if w is None else w
        t = threading.Thread(target=_worker_main, args=(self, w, q), name=f"{self.name}-{w}", daemon=True)
        if new:
            self.queues.append(q)
            self.pins.append(None)
            self.threads.append(t)
        else:
            self.queues[w], self.pins[w], self.threads[w] = q, None, t
        t.start()
        return w

    def respawn_teams(self) -> None:
        """Give every worker that opened an OpenMP team of its own a fresh thread
        (caller holds the lock; the run is over, so they are idle) and tell the old
        threads to exit: their teams go with them (see the module docstring)."""
        for w in sorted(self.teams):
            self.queues[w].put(None)
            self.spawn(w)
        self.teams.clear()

    def hand(self, task: tuple) -> None:
        """Give ``task`` to an idle worker - one already pinned to its cores (or
        unpinned, in a run that does not pin) if any, so it need not move -
        spawning one if none is idle; caller holds the lock."""
        idle = self.idle
        if not idle:
            w = self.spawn()
        else:
            cores, pins = (task[2] if task[0].pin else None), self.pins
            for j in range(len(idle) - 1, -1, -1):
                if pins[idle[j]] == cores:
                    w = idle.pop(j)
                    break
            else:
                w = idle.pop()
        self.queues[w].put(task)


def _shutdown(state: _PoolState, timeout: float | None = None) -> None:
    """Stop and join every worker (idempotent; also the pool's finalizer)."""
    with state.lock:
        if state.closed:
            return
        state.closed = True
        threads = list(state.threads)
        for q in state.queues:
            q.put(None)
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join(timeout)


def _worker_main(state: _PoolState, w: int, q: queue.SimpleQueue) -> None:
    if state.thread_init is not None:
        state.thread_init()
    get = q.get
    while True:
        task = get()
        if task is None:
            return
        run, i, cores = task
        try:
            _drive(state, w, run, i, cores)
        except BaseException as exc:  # a bug in the bookkeeping itself: fail the run, never hang it
            with state.lock:
                if run.error is None:
                    run.error = (-1, exc)
                run.aborted = True
                run.running = 0
                if w not in state.idle:
                    state.idle.append(w)
            _finish(run)


def _pin(state: _PoolState, w: int, cores: tuple[int, ...] | None) -> None:
    """Pin the calling worker ``w`` to the CPUs of slots ``cores`` (None: unpin
    it, back to every CPU the process started with)."""
    cmap, allowed = state.core_map, state.allowed
    if cmap is None or allowed is None or state.pins[w] == cores:  # allowed is set whenever core_map was
        return
    try:
        os.sched_setaffinity(0, allowed if cores is None else {cmap[c] for c in cores})
        state.pins[w] = cores
    except (OSError, AttributeError) as exc:  # not permitted here (container, seccomp, macOS)
        state.pin_error = f"{type(exc).__name__}: {exc}"
        state.core_map = None


def _drive(state: _PoolState, w: int, run: _Run, i: int, cores: tuple[int, ...]) -> None:
    """Run op ``i`` on this thread (worker ``w``, or the calling thread when
    ``w`` is :data:`CALLER_LANE`), then keep running what becomes ready and is
    this thread's to run, until nothing is (a worker then goes back to the
    idle list).  The calling thread keeps multi-threaded ops, a worker
    one-thread ops (and a chain continuing on the cores it holds)."""
    lock = state.lock
    caller = w == CALLER_LANE
    cp = run.cp
    fns, threads, succs, rank, by_rank = cp.fns, cp.threads, cp.succs, cp.rank, cp.by_rank
    free_after, releases = cp.free_after, cp.releases
    values = run.values
    ready, ndeps, free = run.ready, run.ndeps, run.free
    starts, ends, core_rec, lanes = run.starts, run.ends, run.cores, run.lanes
    rcount = run.rcount
    get_threads, set_threads = state.get_threads, state.set_threads
    pins = state.pins
    pin = run.pin
    while True:
        k = threads[i]
        # The first op a thread runs may reset its intra-op count to the process
        # default, so read it first and set ours whenever it differs.
        if get_threads is not None and set_threads is not None and get_threads() != k:
            set_threads(k)
        if not caller:
            if k > 1:
                state.teams.add(w)  # its OpenMP team outlives the op: retired when the run ends
            if state.core_map is not None and pins[w] != (cores if pin else None):
                _pin(state, w, cores if pin else None)
        err = None
        t0 = perf_counter()
        try:
            fns[i](values)
        except BaseException as exc:
            err = exc
        t1 = perf_counter()
        drop = None
        nxt = None
        with lock:
            starts[i] = t0
            ends[i] = t1
            core_rec[i] = cores
            lanes[i] = w
            if err is None:
                run.n_done += 1
                for s in succs[i]:
                    c = ndeps[s] - 1
                    ndeps[s] = c
                    if not c:
                        heappush(ready, rank[s])
                if rcount is not None:
                    drop = free_after[i]
                    for s in releases[i]:
                        c = rcount[s] - 1
                        rcount[s] = c
                        if not c:
                            drop = drop + (s,)
                # The common case (a chain): the only ready op needs exactly the
                # slots this one frees - keep them and run it here, no hand-off.
                if len(ready) == 1 and not run.aborted and threads[by_rank[ready[0]]] == len(cores):
                    nxt = (by_rank[ready.pop()], cores)
            else:
                if run.error is None:
                    run.error = (i, err)
                run.aborted = True
            if nxt is None:
                free.extend(cores)
                if len(free) > 1:
                    free.sort()
                run.running -= 1
                if ready and not run.aborted:
                    for task in _dispatch(run, None if caller else cores):
                        if nxt is None and (threads[task[0]] > 1) == caller:
                            nxt = task
                        else:
                            _give(state, run, task)
                if nxt is None:
                    if caller:
                        run.team_busy = False
                    else:
                        state.idle.append(w)
                    finished = run.running == 0
                    if finished:
                        _check_deadlock(run)
        if drop:
            for s in drop:
                values[s] = None
        if nxt is None:
            if finished:
                _finish(run)
            return
        i, cores = nxt


class WorkerPool:
    """Persistent executor threads over ``slots`` core slots (see the module docstring).

    ``core_map[s]`` is the OS CPU that slot ``s`` is pinned to (``None``: no
    pinning).  ``set_threads`` / ``get_threads`` set and read the calling
    thread's intra-op thread count before each op; ``thread_init`` runs once in
    each new worker (e.g. to disable autograd, which is thread-local).
    ``pin_mixed``: keep workers pinned in plans that have multi-threaded ops
    too (by default they run unpinned there; see the module docstring).
    """

    def __init__(self, slots: int, core_map: list[int] | None = None, name: str = "opsched-exec",
                 set_threads: Callable[[int], None] | None = None, get_threads: Callable[[], int] | None = None,
                 thread_init: Callable[[], None] | None = None, pin_mixed: bool = False,
                 retire_teams: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"WorkerPool needs at least one slot, got {slots}")
        self.slots = slots
        self.pin_mixed = pin_mixed
        #: Whether a worker that ran a multi-threaded op exits when the run ends (the
        #: default; False keeps its OpenMP team alive, the old behaviour, for measuring).
        self.retire_teams = retire_teams
        self._state = _PoolState(core_map, name, set_threads, get_threads, thread_init)
        self._last: _Run | None = None
        self._call_lock = threading.Lock()
        with self._state.lock:
            self._state.idle.append(self._state.spawn())
        # A forgotten pool must not keep threads alive nor hang interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, self._state, 5.0)

    @property
    def pinned(self) -> bool:
        return self._state.core_map is not None

    @property
    def core_map(self) -> list[int] | None:
        """Slot -> OS CPU while pinning is in effect, else None."""
        cmap = self._state.core_map
        return list(cmap) if cmap is not None else None

    def pins_run(self, cp: CompiledPlan) -> bool:
        """Whether a run of ``cp`` pins its workers: pinning is in effect and
        the plan has no multi-threaded op (or ``pin_mixed``)."""
        return self._state.core_map is not None and (self.pin_mixed or max(cp.threads, default=1) == 1)

    @property
    def pin_error(self) -> str | None:
        return self._state.pin_error

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._state.threads)

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Stop and join every worker (idempotent); waits for a run in flight
        in another thread to finish first."""
        with self._call_lock:
            self._finalizer()

    def ensure_workers(self, count: int) -> None:
        """Start workers until there are ``count`` (at most one per slot), so a
        run does not pay for thread creation.  Call between runs."""
        state = self._state
        with self._call_lock, state.lock:
            while not state.closed and len(state.threads) < min(count, self.slots):
                state.idle.append(state.spawn())

    def run(self, cp: CompiledPlan, values: list, free_values: bool = True) -> _Run:
        """Execute ``cp`` over ``values``; return the finished run's state.

        Raises :class:`OpFailure` (with the op index, -1 for an internal error)
        when an op raised, and re-raises ``KeyboardInterrupt`` after running ops
        have finished.  One run at a time: concurrent callers queue up.
        """
        if cp.slots != self.slots:
            raise ValueError(f"plan compiled for {cp.slots} slots, pool has {self.slots}")
        with self._call_lock:
            state = self._state
            if state.closed:
                raise RuntimeError("executor pool is closed")
            prev = self._last
            if prev is not None and not prev.done.is_set():
                # A run interrupted twice left ops running: let them drain first.
                while not prev.done.wait(_WAIT_SLICE_S):
                    pass
            run = _Run(cp, values, free_values, self.pins_run(cp))
            self._last = run
            try:
                self._serve(run)
            except BaseException:
                self._abort(run)
                raise
            finally:
                if run.done.is_set() and self.retire_teams:
                    self._release_teams()
            if run.error is not None:
                if isinstance(run.error[1], KeyboardInterrupt):  # Ctrl-C while this thread ran an op
                    raise KeyboardInterrupt
                raise OpFailure(*run.error)
            return run

    def release_teams(self) -> None:
        """The workers that ran a multi-threaded op exit (fresh threads take their places),
        so the process is back to one OpenMP team: done after every run unless
        ``retire_teams`` is False (waits for a run in flight in another thread)."""
        with self._call_lock:
            self._release_teams()

    def _release_teams(self) -> None:
        """:meth:`release_teams`, the caller holding the call lock (a run is over)."""
        state = self._state
        if not state.teams:
            return
        with state.lock:
            if not state.closed:  # not joined: they are idle and exit at once, and joining costs the run ~0.7 ms
                state.respawn_teams()

    def _serve(self, run: _Run) -> None:
        """The calling thread's part of a run: the first dispatch, then every
        multi-threaded op handed to it, until the run is over."""
        state = self._state
        mine = None
        with state.lock:
            for task in _dispatch(run):
                if mine is None and run.cp.threads[task[0]] > 1:
                    mine = task
                    run.team_busy = True
                else:
                    _give(state, run, task)
            if run.running == 0:  # nothing could start (an empty plan)
                _check_deadlock(run)
                _finish(run)
        if mine is not None:
            _drive(state, CALLER_LANE, run, *mine)
        get, done = run.team_q.get, run.done
        while not done.is_set():
            try:
                task = get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                continue
            if task is not None:
                _drive(state, CALLER_LANE, run, *task)

    def _abort(self, run: _Run) -> None:
        """Stop dispatching; wait (interruptibly) for the ops already running.
        Multi-threaded ops handed to the calling thread and not begun are
        dropped; if nothing runs any more (an interrupt mid-bookkeeping), the
        run is over whatever its counters say."""
        state = self._state
        with state.lock:
            run.aborted = True
            if run.running == 0:
                _finish(run)
        while not run.done.is_set():
            try:
                task = run.team_q.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                task = None
            with state.lock:
                if task is not None:
                    run.free.extend(task[1])
                    run.running -= 1
                    run.team_busy = False
                idle = len(state.idle) == len(state.threads) and run.team_q.empty()
                if run.running <= 0 or (idle and not run.done.is_set()):
                    _finish(run)


def cpu_core_map(slots: int) -> tuple[list[int] | None, str]:
    """Map core slots to OS CPUs: one CPU per physical core first (SMT
    siblings last), among the CPUs this process may run on.

    Returns ``(None, reason)`` when pinning is impossible here: no
    ``os.sched_setaffinity`` (macOS, Windows) or fewer usable CPUs than slots
    (a preset machine larger than this one - its plan still runs, unpinned).
    """
    if not hasattr(os, "sched_setaffinity"):
        return None, "os.sched_setaffinity is not available on this platform"
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < slots:
        return None, f"{slots} core slots but only {len(allowed)} CPUs usable by this process"

    def topo(cpu: int) -> tuple[int, int]:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                pkg = int(f.read())
            with open(base + "core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):
            return (0, cpu)
        return (pkg, core)

    seen: set[tuple[int, int]] = set()
    firsts, siblings = [], []
    for c in allowed:
        key = topo(c)
        (siblings if key in seen else firsts).append(c)
        seen.add(key)
    return (firsts + siblings)[:slots], ""


def run_serial(cp: CompiledPlan, values: list, record: bool = True, free_values: bool = True
               ) -> tuple[list[float], list[float]]:
    """Run a plan whose ops never co-run on the calling thread, in its one order.

    Returns per-op start and end times (``perf_counter``).  Raises
    :class:`OpFailure` when an op raises.
    """
    n = cp.n
    starts = [0.0] * n
    ends = [0.0] * n
    fns = cp.fns
    drops = cp.serial_free if free_values else None
    i = -1
    try:
        if record:
            for i in cp.serial_order or ():
                starts[i] = perf_counter()
                fns[i](values)
                ends[i] = perf_counter()
                if drops is not None:
                    for s in drops[i]:
                        values[s] = None
        else:
            for i in cp.serial_order or ():
                fns[i](values)
                if drops is not None:
                    for s in drops[i]:
                        values[s] = None
    except Exception as exc:
        raise OpFailure(i, exc) from exc
    return starts, ends
