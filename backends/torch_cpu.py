"""The real PyTorch CPU runtime: Graphi-style executors running a Plan.

``TorchCPUBackend(machine).run(graph, plan)`` executes an imported torch graph
(``graph.source``, a :class:`~opsched.importers.torch_fx.TorchSource`) on real
tensors under the plan's exact semantics (``opsched/plan.py``): an op is
ready when its inputs and ``after`` ops are done; at every event the ready
ops are taken by descending priority and each one whose thread count fits in
the free core slots starts at once.  It returns a measured
:class:`~opsched.trace.Trace` (``time.perf_counter`` relative to the run
start; ``meta['wall_s']`` the measured wall time) and ``execute`` returns the
model's outputs instead.

How (see ``executor.py``): the plan is compiled once per (graph, plan) into
flat lists - the importer's generated per-op callables, ready counters,
successor lists, dispatch ranks - and cached.  Persistent executor threads
(one per op that may run at once, at most one per core slot, created on
demand and reused across runs) run the one-thread ops; the calling thread
runs the multi-threaded ones with its own OpenMP team, so the process keeps
one team, shared with eager PyTorch (a second team per executor would make
libgomp throttle its spin-waits and slow every parallel region - eager
included; see ``executor.py``).  When two multi-threaded ops do run side by
side, the worker that ran the second retires when the run ends, taking its
team with it (``bench/omp_teams.py``: eager's inception step 1.95x slower
while such a team lived).  Trace events of ops the calling thread ran
have ``lane == -1``.  Each op takes ``threads``
slots from a free-slot pool; the worker sets its own intra-op thread count
(``torch.get_num_threads()`` first, since the first op a thread runs may reset
it to the process default, then ``torch.set_num_threads(k)``) and pins itself
to the slots' CPUs.  The worker that finishes an op dispatches what became
ready and keeps the first op for itself, so a dependency chain never changes
thread; only ops started side by side wake another worker.  The calling thread
blocks on an event while workers run - it never spins (a caller spinning at
2 intra-op threads steals a core from the workers).

Fast path: a plan in which every op takes every slot can never co-run, so
the semantics reduce to one fixed order; it runs inline on the calling thread
(at that thread count, restored afterwards), still traced, with no pool
round-trip.

Pinning: slot ``s`` is pinned (``os.sched_setaffinity`` on the worker's own
thread) to the ``s``-th usable CPU, one per physical core first.  Where that
is impossible - no ``sched_setaffinity`` (macOS, Windows), a container that
forbids it, or a preset machine with more slots than this process has CPUs -
the run is unpinned: ops still take slots (the trace's ``cores`` are slot
numbers) and ``trace.meta['pinned']`` is False with ``meta['pin_note']``
saying why.  Plans with multi-threaded ops run their workers *unpinned*
(``pin=True``; ``pin="always"`` pins them too): after each parallel region
the caller's OpenMP helper threads spin on cores the kernel chose, and a
worker pinned to such a core runs at half speed while another core idles;
unpinned, the kernel wakes it on the idle one (``executor.py``;
``docs/findings.md`` records the measurement).  The OpenMP team a worker uses for intra-op parallelism is created
by the worker's first multi-threaded op and inherits its affinity then; later
ops reuse that team, so on a machine with many slots a team's helper threads
keep the CPUs of that first op.

Thread-count side effects: ``torch.set_num_threads`` in a worker also moves
the process-wide default that another thread's next conv/matmul may reset to,
so after each pool run the caller's own count is restored.

Allocator note: glibc's malloc returns large blocks to the OS with ``munmap``
and page-faults them back on the next allocation, which costs a large output
tens of microseconds per run and skews comparisons between configurations
(notably the calling thread vs worker threads, which use different arenas).
Raising ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` keeps those
blocks in the heap - but glibc reads them only when the process starts, so
setting ``os.environ`` from Python is too late.  Launch benchmark processes
with :func:`recommended_env` merged into their environment, for every
configuration alike (measured here: three live 20 MB outputs per call went
from ~970 page faults and 22 ms to none and 18 ms).  Inside a running process
the same thresholds can only be set with ``mallopt`` (what
``opsched.backends.profiler.configure_allocator`` does), and the backend does
that when it starts (``keep_heap=True``, the default): a training step frees and
allocates activations and gradients of the whole model every call, and fresh
pages cost its out-of-place ops about a fifth of their time (randwire, batch 4).
The setting is process-wide, so eager PyTorch timed in the same process
(``opsched apply``'s reference rows) runs with it too.

Errors: an op that raises fails the run with
:class:`~opsched.errors.ExecutionError` naming the op id and its fx nodes,
chained to the original exception; ops already running finish first, no
thread is left hung, and the backend serves the next run.  Ctrl-C
(``KeyboardInterrupt`` in the caller) stops dispatching, waits for the running
ops and re-raises.  ``close()`` joins every worker; a forgotten backend's
workers are stopped by a finalizer (at garbage collection or interpreter exit).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch

from opsched.backends.base import BackendBase
from opsched.backends.executor import CompiledPlan, OpFailure, WorkerPool, cpu_core_map, run_serial
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.importers.torch_fx import output_slots
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace, TraceEvent

#: glibc's largest accepted mmap threshold on 64-bit (HEAP_MAX_SIZE / 2 = 32 MiB).
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024


def recommended_env() -> dict[str, str]:
    """Environment variables for benchmark subprocesses (see the allocator
    note in the module docstring): keep freed large blocks in glibc's heap
    instead of unmapping them.  They must be in the environment when the
    process starts; merge them into ``env`` of ``subprocess.run`` / ``os.execve``."""
    return {
        "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD),
    }


_MIXED_NOTE = ("workers unpinned: the plan has multi-threaded ops, whose OpenMP helpers spin on cores "
               "the kernel chooses after each parallel region (pin='always' pins anyway)")


def _worker_init() -> None:
    # Autograd mode is thread-local: workers run inference like run_node_by_node.
    torch.set_grad_enabled(False)


class TorchCPUBackend(BackendBase):
    """Run imported PyTorch graphs on this machine's CPU under a Plan.

    Arguments:
        machine: the machine plans are made for; its ``cpu`` device's
            ``cores`` is the number of core slots.
        pin: pin executor threads to their slots' CPUs where permitted, in
            plans whose ops all run on one thread (``True``, the default);
            also in plans with multi-threaded ops (``"always"``: slower
            here, see the module docstring); never (``False``).
        free_values: drop intermediate tensors once their last reader is done
            (as eager fx code does), keeping peak memory near eager's.
        cache_size: how many compiled (graph, plan) pairs to keep.
    """

    name = "torch-cpu"
    measured = True

    def __init__(self, machine: Machine, pin: bool | str = True, free_values: bool = True,
                 cache_size: int = 32, keep_heap: bool = True) -> None:
        if pin not in (True, False, "always"):
            raise ValueError(f"TorchCPUBackend: pin must be True, False or 'always', got {pin!r}")
        super().__init__(machine)
        if keep_heap:  # process-wide (eager torch in this process gains as much): see the module docstring
            from opsched.backends.profiler import configure_allocator

            self.allocator = configure_allocator()
        self.slots = machine.cpu.cores
        self.free_values = free_values
        self._cache = IdentityLRU(cache_size)
        core_map, note = cpu_core_map(self.slots) if pin else (None, "pinning disabled (pin=False)")
        self._pin_note = note
        self._pool = WorkerPool(self.slots, core_map, name="opsched-torch-cpu",
                                set_threads=torch.set_num_threads, get_threads=torch.get_num_threads,
                                thread_init=_worker_init, pin_mixed=pin == "always")

    # -------------------------------------------------------------- compile
    def compile(self, graph: OpGraph, plan: Plan) -> CompiledPlan:
        """Validate ``plan`` for ``graph`` on this machine and compile it (cached
        by the identity of both; plans and graphs are immutable)."""
        key = (id(graph), id(plan))
        hit = self._cache.get(key, graph, plan)
        if hit is not None:
            return hit
        cp = self._compile(graph, plan)
        if cp.serial_order is None:  # start the workers this plan may use now, not mid-run
            self._pool.ensure_workers(min(self.slots, self.slots // max(1, min(cp.threads, default=1))))
        self._cache.put(key, cp, graph, plan)
        return cp

    def _compile(self, graph: OpGraph, plan: Plan) -> CompiledPlan:
        plan.validate(graph, self.machine)
        off_cpu = [k for k, a in plan.assignments.items() if a.device != "cpu"]
        if off_cpu:
            raise PlanError(
                f"plan for graph {graph.name!r}: the torch-cpu backend runs ops only on device 'cpu', "
                f"but op {off_cpu[0]!r} is placed on {plan[off_cpu[0]].device!r}"
                + (f" (and {len(off_cpu) - 1} more)" if len(off_cpu) > 1 else "")
            )
        src = _torch_source(graph)
        compiled = src.compile_ops()
        index = graph.index
        fns: list[Any] = [None] * len(graph.ops)
        reads: list[tuple[int, ...]] = [()] * len(graph.ops)
        writes: list[tuple[int, ...]] = [()] * len(graph.ops)
        for c in compiled:
            i = index.get(c.op_id)
            if i is None:
                raise ExecutionError(f"graph {graph.name!r}: its torch source has op {c.op_id!r}, "
                                     "which the graph lacks (graph and source do not match)")
            fns[i], reads[i], writes[i] = c.run, tuple(c.reads), tuple(c.writes)
        missing = [graph.ops[i].id for i, f in enumerate(fns) if f is None]
        if missing:
            raise ExecutionError(f"graph {graph.name!r}: its torch source cannot run op(s) {missing[:5]} "
                                 "(graph and source do not match)")
        a = plan.assignments
        deps = [
            set(graph.pred_index[i]) | {index[d] for d in a[op.id].after if d != op.id}
            for i, op in enumerate(graph.ops)
        ]
        return CompiledPlan(
            [op.id for op in graph.ops], fns, [a[op.id].threads for op in graph.ops],
            plan.dispatch_order(graph), deps, self.slots, reads, writes, _protected_slots(src),
        )

    # ------------------------------------------------------------------ run
    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any] | None = None) -> Trace:
        """Execute ``plan`` on ``inputs`` (default: the graph's example inputs)
        and return the measured trace."""
        cp = self.compile(graph, plan)
        src = graph.source
        values = src.new_values(*(src.example_inputs if inputs is None else inputs))
        starts, ends, cores, lanes, t0, wall = self._execute(graph, cp, values, record=True)
        serial = cp.serial_order is not None
        pinned = not serial and self._pool.pins_run(cp)
        threads, op_ids = cp.threads, cp.op_ids
        events = tuple(
            _event(op_ids[i], starts[i] - t0, ends[i] - t0, "cpu", threads[i], cores[i], lanes[i])
            for i in range(cp.n)
        )
        meta = {
            "wall_s": wall,
            "mode": "inline" if serial else "pool",
            "pinned": pinned,
            "pin_note": ("inline runs on the calling thread, unpinned" if serial
                         else self._pool.pin_error or self._pin_note or ("" if pinned else _MIXED_NOTE)),
            "cpus": self._pool.core_map if pinned else None,  # slot s -> OS CPU, when pinned
            "plan": plan.policy,
        }
        return Trace(events, backend=self.name, meta=meta)

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> Any:
        """Execute ``plan`` on ``inputs`` and return the model's outputs
        (what ``module(*inputs)`` returns)."""
        cp = self.compile(graph, plan)
        src = graph.source
        values = src.new_values(*inputs)
        self._execute(graph, cp, values, record=False)
        return src.collect_output(values)

    def _execute(self, graph: OpGraph, cp: CompiledPlan, values: list, record: bool):
        """Run ``cp`` over ``values``: (starts, ends, cores, lanes, t0, wall_s)."""
        if self._pool.closed:
            raise ExecutionError(f"the {self.name} backend is closed; create a new one to run graph {graph.name!r}")
        caller_threads = torch.get_num_threads()
        try:
            if cp.serial_order is not None:
                k = cp.threads[0] if cp.n else caller_threads
                if k != caller_threads:
                    torch.set_num_threads(k)
                with torch.no_grad():
                    t0 = perf_counter()
                    starts, ends = run_serial(cp, values, record=record, free_values=self.free_values)
                    wall = perf_counter() - t0
                every = tuple(range(self.slots))
                return starts, ends, [every] * cp.n, [0] * cp.n, t0, wall
            with torch.no_grad():  # the calling thread runs the multi-threaded ops
                t0 = perf_counter()
                run = self._pool.run(cp, values, free_values=self.free_values)
                wall = perf_counter() - t0
            return run.starts, run.ends, run.cores, run.lanes, t0, wall
        except OpFailure as f:
            raise _execution_error(graph, cp, f) from f.exc
        finally:
            # Workers' set_num_threads moves the process default; give the caller its own back.
            torch.set_num_threads(caller_threads)

    # -------------------------------------------------------------- lifetime
    @property
    def workers(self) -> list[threading.Thread]:
        """The executor threads started so far (for tests and diagnostics)."""
        return self._pool.threads

    def close(self) -> None:
        """Stop and join the executor threads (idempotent)."""
        self._pool.close()
        self._cache.clear()


def _event_fast(op: str, start: float, end: float, device: str, threads: int, cores: tuple[int, ...] | None,
                lane: int | None, _new=object.__new__, _cls=TraceEvent) -> TraceEvent:
    """A TraceEvent without the frozen-dataclass ``__init__`` (one ``object.__setattr__``
    per field): trace building is per op, so it counts in the runtime's overhead."""
    ev = _new(_cls)
    ev.__dict__.update(op=op, start=start, end=end, device=device, threads=threads, cores=cores, lane=lane)
    return ev


# Only valid while TraceEvent is a plain (non-slots) dataclass with exactly these fields.
_event = _event_fast if (
    not hasattr(TraceEvent, "__slots__")
    and tuple(TraceEvent.__dataclass_fields__) == ("op", "start", "end", "device", "threads", "cores", "lane")
) else TraceEvent


def _torch_source(graph: OpGraph) -> Any:
    src = graph.source
    if src is None or not all(hasattr(src, a) for a in ("compile_ops", "new_values", "collect_output")):
        raise ExecutionError(
            f"graph {graph.name!r} has no PyTorch source to execute "
            f"(source is {type(src).__name__}); import it with opsched.importers.torch_fx.from_torch "
            "or opsched.specs.load_graph('zoo:NAME') - a graph loaded from JSON is not executable"
        )
    return src


def _protected_slots(src: Any) -> set[int] | None:
    """Slots never freed early: graph inputs, constants, outputs (None: unknown, free nothing)."""
    try:
        return set(src.input_slots) | set(src.const_slots) | set(output_slots(src.output_spec))
    except AttributeError:
        return None


def _execution_error(graph: OpGraph, cp: CompiledPlan, f: OpFailure) -> ExecutionError:
    exc = f.exc
    if f.index < 0:
        return ExecutionError(f"graph {graph.name!r}: the executor failed: {type(exc).__name__}: {exc}")
    op_id = cp.op_ids[f.index]
    nodes = getattr(graph.source, "op_nodes", {}).get(op_id, (op_id,))
    op = graph.ops[f.index]
    return ExecutionError(
        f"graph {graph.name!r}: op {op_id!r} ({op.name}; fx node{'s' if len(nodes) > 1 else ''} "
        f"{', '.join(nodes)}) raised {type(exc).__name__}: {exc}"
    )
