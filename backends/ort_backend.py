"""The ``ort`` backend: a Plan run as co-running ONNX Runtime sessions.

``OrtBackend(machine).run(graph, plan)`` executes a graph imported with
:func:`opsched.importers.onnx_graph.from_onnx` (the graph ONNX Runtime's
optimiser made, so its kernels: fusions, blocked layouts) under a Plan:

1. **Lowering** (``backends/ort_lower.py``): the plan's simulated schedule,
   under the planning model the plan was made with (``model``, or
   :meth:`OrtBackend.use_model`; the analytic model when none is given), becomes lanes of segments; each
   segment is a sub-model of the graph built once as an ONNX Runtime session
   (sequential mode, graph optimisations off - the nodes are already
   optimised - and the segment's intra-op thread count).  Sessions are cached
   by their nodes, thread count and boundary values, so plans that share a
   segment share its session; a compiled plan is cached by (graph, plan).
   With several sessions each owns its intra-op pool, and pools still
   spinning after their segment ended take the cores the other segments run
   on (plans of one-thread and two-thread segments ran many times slower
   with ONNX Runtime's default spinning, and still several times slower with
   pools that spin only while their ``run`` lasts, ``session.force_spinning_stop``):
   their pools spin for at most :data:`SEGMENT_SPIN_US` between parallel regions
   (``session.intra_op.spin_duration_us``: long enough to bridge the nodes of
   a segment, short enough to free the core soon after it; better here than
   no spinning, which wakes the pool for every node); one session running
   the whole graph spins as ONNX Runtime does by default (``spinning="auto"``).
   ONNX Runtime's global thread pool, which sessions could share, cannot be
   mixed with per-session one-thread sessions.
2. **Lanes on threads.**  Lane 0 runs on the calling thread, every other lane
   on a persistent worker thread (one per lane, started on demand, reused by
   later runs).  ONNX Runtime releases the interpreter lock inside ``run``,
   so lanes compute side by side.  Values cross segments as ``OrtValue``s
   (``run_with_ort_values``: no copies through numpy); a segment that waits
   for another lane blocks on that segment's ``threading.Event``.
   A plan whose one segment is the whole graph in ONNX Runtime's own node
   order on every core runs ONNX Runtime's own session of the model (its
   sequential execution, exactly); in another order, a session of the
   optimised graph with the nodes in that order.
   Weights: each session pre-packs its own copy of the weights it reads
   (MLAS's GEMM and convolution layouts), so a weight several segments read
   (an unrolled LSTM's recurrent matrix, once per step) would exist once per
   segment, and on memory-bound nodes those copies evict each other from the
   caches; such weights are handed to their sessions as the graph's one copy
   (``SessionOptions.add_initializer``) and those sessions do not pre-pack.
3. **Trace.**  A segment's measured start and end bound its ops; the time
   in between is shared among its ops in proportion to their predicted times
   (ONNX Runtime does not time nodes without its profiler, which would slow
   the run).  ``meta``: ``wall_s``, the lowering in numbers, and
   ``op_times: "apportioned"``.

Errors: a session that raises fails the run with
:class:`~opsched.errors.ExecutionError` naming the node (from ONNX Runtime's
message when it names one, else the segment's nodes), chained to the original
exception; every lane stops at its next segment boundary (segments already
running finish), no thread is left waiting, and the backend serves the next
run.  ``KeyboardInterrupt`` in the caller does the same, then re-raises.
``close()`` joins the lane threads; a forgotten backend's threads are stopped
by a finalizer.
"""

from __future__ import annotations

import queue
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Literal

import numpy as np

from opsched.backends.base import BackendBase
from opsched.backends.ort_lower import Lowering, describe, lower
from opsched.engine.contracts import PerfModel
from opsched.errors import ExecutionError, ModelImportError, PlanError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace, TraceEvent

#: Microseconds a segment session's intra-op pool spins between parallel regions (``spinning="auto"``).
SEGMENT_SPIN_US = 50
#: How long the calling thread sleeps between checks for a pending KeyboardInterrupt while it waits.
_WAIT_SLICE_S = 0.1
_NODE_IN_MESSAGE = re.compile(r"node\. Name:'([^']*)'")


def _run_fn(sess: Any) -> Any:
    """``fn(output_names, feeds) -> output values`` of a session, on ONNX Runtime's
    C-level values: the Python wrapper of ``run_with_ort_values`` re-validates
    every input's names and ownership, which costs ten times the run of a small
    node; the values here come from sessions of the same graph, already checked."""
    c = getattr(sess, "_sess", None)
    if c is not None and hasattr(c, "run_with_ort_values"):
        return lambda names, feeds: c.run_with_ort_values(feeds, names, None)
    import onnxruntime as ort

    return lambda names, feeds: [v._get_c_value() for v in sess.run_with_ort_values(
        names, {k: ort.OrtValue(v) for k, v in feeds.items()})]


@dataclass(frozen=True)
class _Segment:
    """A lowered segment with its session (``run``: see :func:`_run_fn`)."""

    index: int
    session: Any
    run: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    waits: tuple[int, ...]
    ops: tuple[int, ...]


class Program:
    """A plan compiled for the ``ort`` backend: segments with sessions, lanes, and
    per op its share of its segment's time (for the trace)."""

    def __init__(self, graph: OpGraph, plan: Plan, lowering: Lowering, segments: Sequence[_Segment],
                 shares: Sequence[tuple[float, float]]) -> None:
        self.graph, self.plan, self.lowering = graph, plan, lowering
        self.segments = tuple(segments)
        #: (lane, its segments in run order) for every lane that runs any
        self.lanes: tuple[tuple[int, tuple[int, ...]], ...] = tuple(
            (lane, segs) for lane, segs in enumerate(lowering.lanes) if segs)
        self.shares = tuple(shares)  # per op: (start, end) as fractions of its segment's time
        self.outputs = tuple(graph.source.outputs)
        # an event per segment another lane waits for, reused by every run (one run at a time: cleared at its start)
        waited = {w for seg in self.segments for w in seg.waits}
        self.events = tuple(threading.Event() if i in waited else None for i in range(len(self.segments)))
        self.event_list = tuple(e for e in self.events if e is not None)


class _Run:
    """One run's values, per-segment events and times, and its failure (if any)."""

    def __init__(self, prog: Program, feeds: dict[str, Any]) -> None:
        n = len(prog.segments)
        self.values = feeds
        self.done = prog.events
        self.events = prog.event_list
        for ev in self.events:
            ev.clear()
        self.starts = [0.0] * n
        self.ends = [0.0] * n
        self.error: tuple[int, BaseException] | None = None
        self.aborted = False
        self.keep: Any = None
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.left = 0  # lanes handed to workers and not done yet

    def fail(self, seg: int, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = (seg, exc)
            self.aborted = True
        for ev in self.events:  # nobody waits for a segment that will never end
            ev.set()

    def lane_started(self) -> None:
        with self.cond:
            self.left += 1

    def lane_done(self) -> None:
        with self.cond:
            self.left -= 1
            self.cond.notify_all()

    def wait_lanes(self, sliced: bool) -> None:
        """Until every lane handed to a worker is done (in slices: a KeyboardInterrupt is noticed)."""
        with self.cond:
            while self.left > 0:
                self.cond.wait(_WAIT_SLICE_S if sliced else None)


def _run_lane(prog: Program, run: _Run, segs: Sequence[int], sliced: bool) -> None:
    """Run one lane's segments in order, waiting for other lanes' segments first."""
    segments, values, done, starts, ends = prog.segments, run.values, run.done, run.starts, run.ends
    for si in segs:
        seg = segments[si]
        for w in seg.waits:
            ev = done[w]
            assert ev is not None  # Program made an event for every segment another one waits for
            if not ev.is_set():
                if sliced:  # the calling thread: notice a KeyboardInterrupt
                    while not ev.wait(_WAIT_SLICE_S):
                        pass
                else:
                    ev.wait()
        if run.aborted:
            return
        try:
            feeds = {x: values[x] for x in seg.inputs}
            t0 = perf_counter()
            outs = seg.run(seg.outputs, feeds)
            t1 = perf_counter()
        except BaseException as exc:  # ORT raises its own types; KeyboardInterrupt too
            run.fail(si, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for name, v in zip(seg.outputs, outs):
            values[name] = v
        starts[si] = t0
        ends[si] = t1
        ev = done[si]
        if ev is not None:
            ev.set()


class _Lanes:
    """The worker threads of lanes 1, 2, ... (kept apart from the backend so that a
    forgotten backend can be collected and its finalizer stop them).  With ``cpus``,
    lane ``l``'s thread pins itself to ``cpus[l % len(cpus)]``."""

    def __init__(self, name: str, cpus: list[int] | None = None) -> None:
        self.name = name
        self.cpus = cpus
        self.lock = threading.Lock()
        self.queues: list[queue.SimpleQueue] = []
        self.threads: list[threading.Thread] = []
        self.closed = False

    def submit(self, lane: int, task: tuple) -> None:
        with self.lock:
            if self.closed:
                raise ExecutionError("the ort backend is closed")
            while len(self.queues) < lane:
                q: queue.SimpleQueue = queue.SimpleQueue()
                n = len(self.queues) + 1
                cpu = self.cpus[n % len(self.cpus)] if self.cpus else None
                t = threading.Thread(target=_lane_main, args=(q, cpu), name=f"{self.name}-{n}", daemon=True)
                self.queues.append(q)
                self.threads.append(t)
                t.start()
            self.queues[lane - 1].put(task)


def _lane_main(q: queue.SimpleQueue, cpu: int | None = None) -> None:
    if cpu is not None:
        _pin({cpu})
    while True:
        task = q.get()
        if task is None:
            return
        prog, run, segs = task
        try:
            _run_lane(prog, run, segs, sliced=False)
        except BaseException as exc:  # never lose an error in a thread
            run.fail(-1, exc)
        finally:
            run.lane_done()


def _pin(cpus: set[int]) -> set[int] | None:
    """Pin the calling thread to ``cpus``; its previous CPUs, or None where that is not possible."""
    import os

    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        return before
    except (AttributeError, OSError):
        return None


def _pinnable_cpus(lanes: int) -> list[int] | None:
    """One CPU per lane (the process's CPUs, in order) when there are enough, else None."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cpus if len(cpus) >= lanes else None


def _shutdown(lanes: _Lanes) -> None:
    with lanes.lock:
        if lanes.closed:
            return
        lanes.closed = True
        for q in lanes.queues:
            q.put(None)
        threads = list(lanes.threads)
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join()


class OrtBackend(BackendBase):
    """Run ONNX graphs on this machine's CPU as co-running ONNX Runtime sessions under a Plan.

    Arguments:
        machine: the machine plans are made for (its ``cpu`` cores are the lanes).
        model: the planning model the plan's schedule is simulated with for
            lowering (default: the analytic model; ``opsched.apply`` and ``compare``
            pass the planning model the plans were made with, :meth:`use_model`).
        spinning: how sessions' intra-op pools spin-wait between parallel
            regions: ``"auto"`` (default) as ONNX Runtime does when one session
            runs the whole graph, for at most :data:`SEGMENT_SPIN_US` in a
            plan of several sessions (a pool spinning after its segment ended
            takes the core another segment runs on); ``True`` / ``False``:
            as ONNX Runtime does / never, in every plan.
        cache_size: compiled (graph, plan) pairs kept; ``session_cache``:
            segment sessions kept.
        pin: in plans of several lanes, pin lane ``l``'s thread to the
            process's ``l``-th CPU (the calling thread for the run's length)
            where there are enough CPUs: a lane's nodes then find their
            weights in the caches of the core that ran them the last time.
    """

    name = "ort"
    measured = True

    def __init__(self, machine: Machine, model: PerfModel | None = None,
                 spinning: bool | Literal["auto"] = "auto",
                 cache_size: int = 16, session_cache: int = 2048, pin: bool = True) -> None:
        if spinning not in (True, False, "auto"):
            raise ValueError(f"OrtBackend: spinning must be True, False or 'auto', got {spinning!r}")
        super().__init__(machine)
        self._model = model
        self.spinning: bool | Literal["auto"] = spinning
        self._programs = IdentityLRU(cache_size)
        self._sessions = IdentityLRU(session_cache)
        #: One run at a time: lanes of two runs queued on the same workers could wait for each other.
        self._run_lock = threading.Lock()
        self.pin = pin
        self._cpus = _pinnable_cpus(machine.cpu.cores) if pin else None
        self._lanes = _Lanes("opsched-ort-lane", self._cpus)
        self._finalizer = weakref.finalize(self, _shutdown, self._lanes)

    @property
    def model(self) -> PerfModel:
        """The planning model plans are lowered with."""
        if self._model is None:
            from opsched.engine.sim import default_perf_model

            self._model = default_perf_model()
        return self._model

    def use_model(self, model: PerfModel) -> None:
        """Lower with ``model`` from now on, unless a model was given or already chosen."""
        if self._model is None:
            self._model = model

    # -------------------------------------------------------------- compile
    def compile(self, graph: OpGraph, plan: Plan) -> Program:
        """Validate ``plan`` for ``graph``, lower it and build its sessions (cached)."""
        key = (id(graph), id(plan))
        hit = self._programs.get(key, graph, plan)
        if hit is not None:
            return hit
        prog = self._compile(graph, plan)
        self._programs.put(key, prog, graph, plan)
        return prog

    def _compile(self, graph: OpGraph, plan: Plan) -> Program:
        plan.validate(graph, self.machine)
        off_cpu = [k for k, a in plan.assignments.items() if a.device != "cpu"]
        if off_cpu:
            raise PlanError(f"plan for graph {graph.name!r}: the ort backend runs ops only on device 'cpu', "
                            f"but op {off_cpu[0]!r} is placed on {plan[off_cpu[0]].device!r}")
        src = _onnx_source(graph)
        model = self.model
        lowering = lower(graph, plan, self.machine, model)
        table = model.time_table(graph, self.machine)
        cpu = self.machine.device_index["cpu"]
        shares: list[tuple[float, float]] = [(0.0, 1.0)] * len(graph.ops)
        weights = [{x for i in s.ops for x in src.nodes[graph.ops[i].id].input if x in src.initializers}
                   for s in lowering.segments]
        uses: dict[str, int] = {}
        for ws in weights:
            for w in ws:
                uses[w] = uses.get(w, 0) + 1
        segments = []
        for s, ws in zip(lowering.segments, weights, strict=True):
            ids = [graph.ops[i].id for i in s.ops]
            spin = self.spinning if self.spinning != "auto" else (True if lowering.single else SEGMENT_SPIN_US)
            sess = self._session(src, ids, s, spin, tuple(sorted(w for w in ws if uses[w] > 1)))
            segments.append(_Segment(s.index, sess, _run_fn(sess), s.inputs, s.outputs, s.waits, s.ops))
            t = np.array([max(_predicted(model, table, graph, self.machine, i, cpu, s.threads), 1e-9) for i in s.ops])
            edges = np.concatenate([[0.0], np.cumsum(t) / t.sum()])
            edges[-1] = 1.0
            for k, i in enumerate(s.ops):
                shares[i] = (float(edges[k]), float(edges[k + 1]))
        return Program(graph, plan, lowering, segments, shares)

    def _session(self, src: Any, ids: list[str], s: Any, spin: bool | int, shared: tuple[str, ...] = ()) -> Any:
        """The session of segment ``s`` (nodes ``ids``); ``shared``: weights other
        segments read too - given to it as the graph's one copy, unpacked."""
        import onnxruntime as ort

        from opsched.importers.onnx_graph import session_options

        key = (id(src), tuple(ids), s.threads, s.inputs, s.outputs, spin, shared)
        hit = self._sessions.get(key, src)
        if hit is not None:
            return hit
        # the whole graph on every core of this process: ONNX Runtime's default pool, as its own sequential run;
        # in ONNX Runtime's own node order, its own session of the model (exactly its sequential execution)
        whole = len(ids) == len(src.nodes) and s.threads == self.machine.cpu.cores == _usable_cpus()
        own = whole and spin is True and tuple(ids) == tuple(getattr(src, "ort_order", ()))
        data = src.original if own else src.submodel(ids, s.inputs, s.outputs, name=f"segment{s.index}")
        so = session_options(0 if whole else s.threads, src.opt_level if own else "disable", spin)
        if shared:  # one copy of a weight for every segment that reads it, not one (pre-packed) copy each
            for w in shared:
                so.add_initializer(w, src.shared_weight(w))
            so.add_session_config_entry("session.disable_prepacking", "1")
        try:
            sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ExecutionError(f"ONNX Runtime cannot build the session of nodes {ids[:3]}"
                                 f"{' ...' if len(ids) > 3 else ''}: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}") from exc
        self._sessions.put(key, sess, src)
        return sess

    # ------------------------------------------------------------------ run
    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any] | None = None) -> Trace:
        """Execute ``plan`` (on ``inputs``, default the graph's example inputs) and return the measured trace."""
        prog = self.compile(graph, plan)
        src = graph.source
        run, t0, wall = self._execute(prog, src.example_inputs if inputs is None else inputs)
        events = []
        for s in prog.segments:
            a, b = run.starts[s.index] - t0, run.ends[s.index] - t0
            low = prog.lowering.segments[s.index]
            for i in s.ops:
                f0, f1 = prog.shares[i]
                events.append(TraceEvent(graph.ops[i].id, a + f0 * (b - a), a + f1 * (b - a), "cpu",
                                         low.threads, low.held, low.lane))
        meta = {"wall_s": wall, "op_times": "apportioned", "plan": plan.policy,
                "lowering": describe(prog.lowering), "sim_makespan_s": prog.lowering.sim_makespan}
        return Trace(tuple(sorted(events, key=lambda e: (e.start, e.end))), backend=self.name, meta=meta)

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> list[np.ndarray]:
        """Execute ``plan`` on ``inputs`` and return the graph's outputs (numpy arrays, in output order)."""
        prog = self.compile(graph, plan)
        run, _, _ = self._execute(prog, inputs)
        return [run.values[name].numpy() for name in prog.outputs]

    def _execute(self, prog: Program, inputs: Sequence[Any]) -> tuple[_Run, float, float]:
        import onnxruntime as ort

        if self._lanes.closed:
            raise ExecutionError(f"the {self.name} backend is closed; create a new one to run graph "
                                 f"{prog.graph.name!r}")
        src = prog.graph.source
        try:
            arrays = src.check_inputs(inputs)
        except ModelImportError as exc:
            raise ExecutionError(f"graph {prog.graph.name!r}: {exc}") from None
        arrays = [np.ascontiguousarray(a) for a in arrays]  # kept alive by the run: the values point into them
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(a)._get_c_value()
                 for name, a in zip(src.inputs, arrays, strict=True)}
        with self._run_lock:
            return self._execute_locked(prog, feeds, arrays)

    def _execute_locked(self, prog: Program, feeds: dict[str, Any], arrays: list[np.ndarray]
                        ) -> tuple[_Run, float, float]:
        run = _Run(prog, feeds)
        run.keep = arrays  # the input values point into these arrays: alive as long as the run's values
        lanes = prog.lanes
        if len(prog.segments) == 1:  # one session: run it, nothing to wait for or hand over
            seg = prog.segments[0]
            t0 = perf_counter()
            try:
                outs = seg.run(seg.outputs, feeds)
            except Exception as exc:  # ORT raises its own types
                raise _execution_error(prog, 0, exc) from exc
            t1 = perf_counter()
            run.values.update(zip(seg.outputs, outs))
            run.starts[0], run.ends[0] = t0, t1
            return run, t0, t1 - t0
        first, others = lanes[0], lanes[1:]  # the calling thread runs the first lane, workers the others
        before = _pin({self._cpus[first[0] % len(self._cpus)]}) if self._cpus and others else None
        t0 = perf_counter()
        try:
            for lane, segs in others:
                self._lanes.submit(lane, (prog, run, segs))
                run.lane_started()
            _run_lane(prog, run, first[1], sliced=True)
            run.wait_lanes(sliced=True)
        except KeyboardInterrupt:
            run.fail(-1, KeyboardInterrupt())
            run.wait_lanes(sliced=False)  # segments already running finish; the lanes stop at their next one
            raise
        finally:
            if before is not None:
                _pin(before)
        wall = perf_counter() - t0
        if run.error is not None:
            raise _execution_error(prog, *run.error) from run.error[1]
        return run, t0, wall

    # -------------------------------------------------------------- lifetime
    @property
    def workers(self) -> list[threading.Thread]:
        """The lane threads started so far (for tests and diagnostics)."""
        return list(self._lanes.threads)

    def close(self) -> None:
        """Stop and join the lane threads, drop the sessions (idempotent)."""
        self._finalizer()
        self._programs.clear()
        self._sessions.clear()


def _usable_cpus() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _predicted(model: PerfModel, table: Any, graph: OpGraph, machine: Machine, i: int, d: int, k: int) -> float:
    """Op ``i``'s predicted seconds at ``k`` threads (the model itself between the table's levels)."""
    if k in table.level_index[d]:
        return float(table.time(i, d, k))
    return float(model.op_time(graph.ops[i], machine.devices[d], k))


def _onnx_source(graph: OpGraph) -> Any:
    return graph.source_with(("submodel", "check_inputs", "outputs"), ExecutionError, "ONNX source to execute",
                             "opsched.importers.onnx_graph.from_onnx or opsched.specs.load_onnx_graph")


def _execution_error(prog: Program, seg: int, exc: BaseException) -> ExecutionError:
    graph = prog.graph
    if seg < 0:
        return ExecutionError(f"graph {graph.name!r}: the ort backend failed: {type(exc).__name__}: {exc}")
    ids = [graph.ops[i].id for i in prog.segments[seg].ops]
    msg = str(exc)
    found = _NODE_IN_MESSAGE.search(msg)
    if found and found.group(1) in ids:
        where = f"node {found.group(1)!r} ({graph.op(found.group(1)).name})"
    elif len(ids) == 1:
        where = f"node {ids[0]!r} ({graph.op(ids[0]).name})"
    else:
        where = f"one of nodes {', '.join(repr(x) for x in ids[:5])}{' ...' if len(ids) > 5 else ''}"
    first = msg.splitlines()[0][:400] if msg else ""
    return ExecutionError(f"graph {graph.name!r}: {where} raised {type(exc).__name__}: {first}")


__all__ = ["SEGMENT_SPIN_US", "OrtBackend", "Program"]
