"""The real TensorFlow runtime: run an imported TF graph under a Plan, measured.

``TFBackend(machine).run(graph, plan)`` executes a graph imported by
:func:`opsched.importers.tf_graph.from_keras` / ``from_tf_function`` (its
``source`` is a :class:`~opsched.importers.tf_graph.TFSource`: a frozen
GraphDef) in a TensorFlow worker process and returns a measured
:class:`~opsched.trace.Trace` whose events are TensorFlow's own per-node step
stats (``RunMetadata`` of a ``FULL_TRACE`` run); ``trace.meta['wall_s']`` is
the median wall time of untraced runs after warm-up.  Also:
``execute(graph, plan, inputs)`` returns the outputs; ``time_plan(graph,
plan)`` times a plan untraced; ``measure(graph, TFSettings(inter, intra))``
times plain TensorFlow at a setting (TF's own placement and order, for
``bench/keras_settings.py`` and ``opsched apply``); :func:`profile_tf`
(below); ``tf_default()`` and ``tf_recommended(machine)`` name the usual
settings.

What TensorFlow lets a caller control, and how a Plan maps onto it
-----------------------------------------------------------------
* **Thread pools, per process.**  TF has one inter-op pool (how many ops run
  at once) and one intra-op pool (threads inside one op), both sized when TF
  initialises and never again.  So each ``(inter, intra)`` setting runs in its
  own worker process (``opsched.backends.tf_worker``, started with
  ``subprocess`` and reused for every run of that setting).  From a Plan:
  ``plan.meta['intra_op']`` / ``['inter_op']`` when present (0 = let TF
  choose); otherwise ``intra`` = the most common per-op thread count and
  ``inter`` = the plan's maximum useful concurrency: the most ops its slot
  schedule (below) ever runs at once.
* **Order and co-running, through control dependencies.**  TF has no op
  priorities and no per-op thread counts - the two things it cannot do from
  outside.  What it can do is wait: the plan is list-scheduled under its
  exact semantics (``opsched/plan.py``) by the simulator (``SimBackend`` with
  the analytic model), which gives every op the slots it holds; then, on
  each slot, every op gets a control dependency on the previous op that held
  that slot.  Ops sharing a slot therefore never overlap in the real run, so
  a device's slot capacity holds whatever the real op times are, and on one
  slot the ops run in exactly the plan's greedy priority order.  ``after``
  waits become control dependencies as well.  An op's ``threads`` is thus
  honoured as slots held (what the trace reports), while the threads that
  actually work inside it are the process-wide ``intra`` (``meta['intra_op']``).
  A plan with ``meta['tf_order']`` gets no slot chains: its pool sizes,
  placement and ``after`` waits, in TensorFlow's own order (the framework's
  run at the plan's setting: a candidate a measured choice can time).
* **Placement.**  ``tf.device`` per node (the GraphDef's device field):
  ``cpu`` -> ``/device:CPU:0``; ``gpu:i`` -> ``/device:GPU:i`` when TF sees
  GPUs, else a logical CPU device (the CPU split with
  ``tf.config.set_logical_device_configuration`` / ``device_count``), so a
  multi-device plan runs - with TF's Send/Recv between devices - on a
  CPU-only machine too.  Logical CPU devices share the process's thread
  pools: they separate placement, not cores.

Per-op times and fusion.  Grappler still optimises the graph at run time,
except its arithmetic optimizer (whose rewrites move work across ops - a Relu
hoisted over a Concat - so a step-stats node would no longer be the op it is
named after).  Its remapper fuses chains such as Pad+Conv2D or
Sigmoid+Mul (Swish) into one kernel named after the chain's last op; an op
that vanished that way (``meta['fused']``) gets a slice of its host kernel's
interval in proportion to the analytic model's estimate, falling back to a
zero-length event at its inputs' end if the slice would break a dependency
or a slot.  Nodes that are not ops of the graph (constants, feeds, views such
as Reshape) are not events; their time is ``meta['untracked_s']``.

Profiles.  :func:`profile_tf` measures every op alone (``inter=1``) at each
intra-op thread level from the same step stats and returns the JSON
``Profile`` of ``opsched.backends.profiler``, so the fitted performance model
and the simulator work from TensorFlow measurements as they do from torch's.

Workers never outlive the backend: ``close()`` (also at interpreter exit)
asks each to quit, then terminates and kills it; a worker dies with its
parent (``PR_SET_PDEATHSIG``), and one that crashes or hangs past
``timeout_s`` fails the call with an :class:`~opsched.errors.ExecutionError`
that quotes its stderr.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import tempfile
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opsched.backends.base import BackendBase
from opsched.backends.tf_wire import array_to_bytes, bytes_to_array
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace, TraceEvent

#: Step-stats node types that are runtime plumbing, never ops of a graph.
_PLUMBING = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv", "_Arg", "_Retval", "NoOp", "Const",
                       "HostConst", "_SOURCE", "_SINK", "Placeholder"})


# ----------------------------------------------------------------- settings
@dataclass(frozen=True)
class TFSettings:
    """TensorFlow's two thread-pool sizes (0 = TensorFlow chooses)."""

    inter: int
    intra: int
    source: str = "explicit"  # "plan.meta" | "derived" | "explicit"

    def __post_init__(self) -> None:
        for f in ("inter", "intra"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"TF setting {f}={v!r}: must be an int >= 0 (0 lets TensorFlow choose)")

    @property
    def label(self) -> str:
        return f"inter={self.inter},intra={self.intra}"

    def effective(self) -> tuple[int, int]:
        """(inter, intra) with 0 replaced by what TF picks: the schedulable CPUs."""
        n = _schedulable_cpus()
        return (self.inter or n, self.intra or n)


def tf_default() -> TFSettings:
    """TensorFlow's own choice: both pools 0."""
    return TFSettings(0, 0, "tf-default")


def tf_recommended(machine: Machine) -> TFSettings:
    """The usual CPU advice (Intel's TF performance guide): intra = physical
    cores per socket, inter = number of sockets."""
    cpu = machine.cpu
    return TFSettings(max(1, cpu.sockets), cpu.cores_per_socket, "tf-recommended")


def _schedulable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------- the worker
class _WorkerProc:
    """One TF worker process for one setting, spoken to over its stdin/stdout."""

    def __init__(self, inter: int, intra: int, cpu_devices: int, arithmetic: bool, startup_timeout_s: float) -> None:
        self.key = (inter, intra, cpu_devices, arithmetic)
        self.label = f"TensorFlow worker (inter={inter}, intra={intra})"
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        cmd = [sys.executable, "-m", "opsched.backends.tf_worker", "--inter", str(inter), "--intra", str(intra),
               "--cpu-devices", str(cpu_devices), "--parent", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env, close_fds=True)
        self.loaded: set[str] = set()
        self.hello, _ = self._read(startup_timeout_s)
        if not self.hello.get("ok"):
            self.kill()
            raise ExecutionError(f"{self.label} failed to start: {self.hello.get('error')}")
        self.pid = int(self.hello["pid"])

    # -- framing with a deadline (the parent must never hang on a stuck worker)
    def _read_exact(self, n: int, deadline: float) -> bytes:
        import time

        assert self.proc.stdout is not None  # started with stdout=PIPE
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ExecutionError(f"{self.label} did not answer in time; it was killed. {self.stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                self.proc.wait(timeout=5)
                raise ExecutionError(f"{self.label} exited with code {self.proc.returncode}. {self.stderr_tail()}")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read(self, timeout_s: float) -> tuple[dict[str, Any], list[bytes]]:
        import json
        import struct
        import time

        deadline = time.monotonic() + timeout_s
        ln = struct.Struct("<Q")

        def frame() -> bytes:
            (n,) = ln.unpack(self._read_exact(ln.size, deadline))
            return self._read_exact(n, deadline)

        header = json.loads(frame().decode())
        return header, [frame() for _ in range(int(header.get("nblobs", 0)))]

    def request(self, header: dict[str, Any], blobs: Sequence[bytes] = (),
                timeout_s: float = 600.0) -> tuple[dict[str, Any], list[bytes]]:
        from opsched.backends.tf_wire import write_message

        if self.proc.poll() is not None:
            raise ExecutionError(f"{self.label} is not running (exit code {self.proc.returncode}). "
                                 f"{self.stderr_tail()}")
        assert self.proc.stdin is not None  # started with stdin=PIPE
        try:
            write_message(self.proc.stdin, header, blobs)  # pyright: ignore[reportArgumentType] - a binary pipe
        except (BrokenPipeError, OSError):
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
            raise ExecutionError(f"{self.label} died (exit code {self.proc.returncode}). "
                                 f"{self.stderr_tail()}") from None
        try:
            reply, out = self._read(timeout_s)
        except BaseException:
            # A timeout, a crash or Ctrl-C mid-message: the stream is out of step; stop the worker.
            self.kill()
            raise
        if not reply.get("ok"):
            raise ExecutionError(f"{self.label}: {reply.get('error', 'unknown error')}")
        return reply, out

    def stderr_tail(self, n: int = 1500) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - n))
            text = self.stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"Its stderr ends: {text}" if text else "It wrote nothing to stderr."

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            try:
                self.request({"cmd": "quit"}, timeout_s=timeout_s)
            except ExecutionError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._cleanup()

    def kill(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._cleanup()

    def _cleanup(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def _stop_workers(workers: dict[tuple, _WorkerProc]) -> None:
    """Close every worker in ``workers`` (the backend's finalizer: at close, collection or exit)."""
    for w in list(workers.values()):
        w.close()
    workers.clear()


# ----------------------------------------------------------------- backend
class TFBackend(BackendBase):
    """Run TensorFlow graphs under Plans on real threads, one process per thread setting.

    Arguments:
        machine: the machine plans are made for.
        warmup: untraced runs before timing (per call).
        repeats: timed untraced runs per ``run`` (``meta['wall_s']`` is their median).
        trace_runs: traced runs per ``run``; the trace is the one with the median span.
        timeout_s: longest a worker may take to answer one request.
        arithmetic: keep Grappler's arithmetic optimizer on (per-op times may then
            be attributed to the wrong op; see the module docstring).
        seed: seed of the random inputs ``run`` feeds.
    """

    name = "tf"
    measured = True

    def __init__(self, machine: Machine, warmup: int = 2, repeats: int = 5, trace_runs: int = 3,
                 timeout_s: float = 600.0, startup_timeout_s: float = 180.0, arithmetic: bool = False,
                 seed: int = 0) -> None:
        super().__init__(machine)
        self.warmup, self.repeats, self.trace_runs = max(0, warmup), max(0, repeats), max(1, trace_runs)
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.arithmetic = arithmetic
        self.seed = seed
        self._workers: dict[tuple, _WorkerProc] = {}
        self._keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._schedules: dict[tuple[int, int], tuple[OpGraph, Plan, Any]] = {}
        self._closed = False
        # Stops the workers at close(), when the backend is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ------------------------------------------------------------- mapping
    def settings_for(self, graph: OpGraph, plan: Plan) -> TFSettings:
        """The (inter, intra) a plan runs with (see the module docstring)."""
        meta = plan.meta or {}
        if "intra_op" in meta or "inter_op" in meta:
            try:
                return TFSettings(int(meta.get("inter_op", 0)), int(meta.get("intra_op", 0)), "plan.meta")
            except (TypeError, ValueError):
                raise PlanError(f"plan {plan.policy!r}: meta intra_op/inter_op must be ints, got "
                                f"{meta.get('intra_op')!r}/{meta.get('inter_op')!r}") from None
        _, inter = self._slot_schedule(graph, plan)
        counts = Counter(plan[op.id].threads for op in graph.ops if not self.machine.device(plan[op.id].device).is_gpu)
        intra = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else 1
        return TFSettings(max(1, inter), intra, "derived")

    def _slot_schedule(self, graph: OpGraph, plan: Plan) -> tuple[dict[str, tuple[str, ...]], int]:
        """Simulate the plan; return each op's slot-chain predecessors and the peak concurrency (cached)."""
        key = (id(graph), id(plan))
        hit = self._schedules.get(key)
        if hit is not None and hit[0] is graph and hit[1] is plan:
            return hit[2]
        result = self._simulate_slots(graph, plan)
        self._schedules[key] = (graph, plan, result)
        while len(self._schedules) > 16:
            self._schedules.pop(next(iter(self._schedules)))
        return result

    def _simulate_slots(self, graph: OpGraph, plan: Plan) -> tuple[dict[str, tuple[str, ...]], int]:
        from opsched.backends.sim import SimBackend

        sim = SimBackend(self.machine).run(graph, plan)
        events = sorted(sim.events, key=lambda e: (e.start, e.end, graph.index[e.op]))
        last: dict[tuple[str, int], str] = {}
        free: dict[str, list[int]] = {d.id: list(range(d.cores)) for d in self.machine.devices}
        running: list[tuple[float, str, str, tuple[int, ...]]] = []
        chain: dict[str, tuple[str, ...]] = {}
        peak = 0
        for e in events:
            running.sort()
            still = []
            for end, op_id, dev, slots in running:
                if end <= e.start:
                    free[dev].extend(slots)
                else:
                    still.append((end, op_id, dev, slots))
            running = still
            k = plan[e.op].threads
            pool = sorted(free[e.device])
            if e.cores is not None and len(e.cores) == k and set(e.cores) <= set(pool):
                slots = tuple(sorted(e.cores))  # the simulator's own slots
                rest = [c for c in pool if c not in slots]
            else:
                slots, rest = tuple(pool[:k]), pool[k:]
            free[e.device] = rest
            preds = set(graph.predecessors(e.op))
            chain[e.op] = tuple(sorted({last[(e.device, s)] for s in slots if (e.device, s) in last} - preds))
            for s in slots:
                last[(e.device, s)] = e.op
            running.append((e.end, e.op, e.device, slots))
            peak = max(peak, len(running))
        return chain, peak

    # -------------------------------------------------------------- workers
    def _worker(self, settings: TFSettings) -> _WorkerProc:
        if self._closed:
            raise ExecutionError("TFBackend is closed")
        cpu_devices = 1 + len(self.machine.gpus)
        key = (settings.inter, settings.intra, cpu_devices, self.arithmetic)
        w = self._workers.get(key)
        if w is not None and not w.alive():
            tail = w.stderr_tail()
            code = w.proc.returncode
            w.kill()
            del self._workers[key]
            raise ExecutionError(f"{w.label} exited with code {code} since its last run. {tail}")
        if w is None:
            w = _WorkerProc(settings.inter, settings.intra, cpu_devices, self.arithmetic, self.startup_timeout_s)
            self._workers[key] = w
        return w

    def _request(self, w: _WorkerProc, header: dict[str, Any], blobs: Sequence[bytes] = ()) -> tuple[Any, Any]:
        """A request to ``w``; a worker that died on it is dropped so the next call starts a fresh one."""
        try:
            return w.request(header, blobs, timeout_s=self.timeout_s)
        except BaseException:
            if not w.alive():
                self._workers.pop(w.key, None)
            raise

    def _graph_key(self, graph: OpGraph) -> str:
        src = _source(graph)
        key = self._keys.get(src)
        if key is None:
            key = hashlib.sha256(src.graph_def).hexdigest()[:20]
            self._keys[src] = key
        return key

    def _call(self, graph: OpGraph, settings: TFSettings, inputs: Sequence[np.ndarray] | None = None,
              placement: Mapping[str, str] | None = None, after: Mapping[str, Sequence[str]] | None = None,
              warmup: int = 0, repeats: int = 0, trace_runs: int = 0,
              return_outputs: bool = False) -> tuple[dict[str, Any], list[np.ndarray]]:
        src = _source(graph)
        # --- a training step (opsched.importers.tf_step): its variables live in the worker; these
        # calls train its scratch state (opsched.backends.tf_train)
        from opsched.backends.tf_train import call as call_step
        from opsched.backends.tf_train import is_step

        if is_step(graph):
            return call_step(self, graph, settings, inputs, placement, after, warmup, repeats, trace_runs,
                             return_outputs)
        # ---
        w = self._worker(settings)
        key = self._graph_key(graph)
        if key not in w.loaded:
            self._request(w, {"cmd": "load", "key": key, "feeds": [t.name for t in src.inputs],
                              "fetches": list(src.outputs), "arithmetic": self.arithmetic}, [src.graph_def])
            w.loaded.add(key)
        feeds = list(inputs) if inputs is not None else src.random_inputs(self.seed)
        if len(feeds) != len(src.inputs):
            raise ExecutionError(f"graph {graph.name!r} takes {len(src.inputs)} input(s), got {len(feeds)}")
        blobs = []
        for t, a in zip(src.inputs, feeds):
            a = np.asarray(a)
            if tuple(a.shape) != tuple(t.shape):
                raise ExecutionError(f"graph {graph.name!r}: input {t.name!r} needs shape {t.shape}, got {a.shape}")
            blobs.append(array_to_bytes(a.astype(t.dtype, copy=False)))
        reply, out = self._request(w, {"cmd": "run", "key": key, "placement": dict(placement or {}),
                                       "after": {k: list(v) for k, v in (after or {}).items() if v},
                                       "warmup": warmup, "repeats": repeats, "trace_runs": trace_runs,
                                       "return_outputs": return_outputs}, blobs)
        reply["worker_pid"] = w.pid
        return reply, [bytes_to_array(b) for b in out]

    # ------------------------------------------------------------ public API
    def _plan_args(self, graph: OpGraph, plan: Plan) -> tuple[TFSettings, dict[str, str], dict[str, list[str]]]:
        """What a plan becomes in TF: thread settings, per-node placement, control dependencies."""
        plan.validate(graph, self.machine)
        _source(graph)
        settings = self.settings_for(graph, plan)
        # plan.meta["tf_order"]: pool sizes from the plan, order left to TensorFlow (no slot chains)
        chain, _ = self._slot_schedule(graph, plan) if not plan.meta.get("tf_order") else ({}, 0)
        after = {op.id: sorted(set(chain.get(op.id, ())) | set(plan[op.id].after)) for op in graph.ops}
        placement = {op.id: plan[op.id].device for op in graph.ops}
        return settings, placement, after

    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[np.ndarray] | None = None) -> Trace:
        """Execute ``plan`` for real (on ``inputs``, default the graph's random
        inputs); one event per op from TF's step stats."""
        settings, placement, after = self._plan_args(graph, plan)
        reply, _ = self._call(graph, settings, inputs=inputs, placement=placement, after=after, warmup=self.warmup,
                              repeats=self.repeats, trace_runs=self.trace_runs)
        spans = []
        for raw in reply["traces"]:
            timed = _match(graph, raw)[0]
            spans.append(max(e for _, e in timed.values()) - min(s for s, _ in timed.values()) if timed else 0)
        pick = int(np.argsort(spans)[len(spans) // 2])
        events, meta = build_events(graph, plan, reply["traces"][pick], self.machine)
        inter_eff, intra_eff = settings.effective()
        meta.update({
            "wall_s": float(np.median(reply["wall_s"])) if reply["wall_s"] else meta["span_s"],
            "wall_all_s": [float(x) for x in reply["wall_s"]],
            "inter_op": settings.inter, "intra_op": settings.intra, "settings_from": settings.source,
            "inter_op_effective": inter_eff, "intra_op_effective": intra_eff,
            "control_deps": sum(len(v) for v in after.values()),
            "misplaced": reply.get("misplaced", {}), "worker_pid": reply["worker_pid"],
            "policy": plan.policy, "traced_spans_s": [s * 1e-9 for s in spans],
        })
        return Trace(tuple(events), backend=self.name, meta=meta)

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Run once under ``plan``'s settings, placement and order and return the outputs."""
        settings, placement, after = self._plan_args(graph, plan)
        _, outs = self._call(graph, settings, inputs=inputs, placement=placement, after=after,
                             return_outputs=True)
        return outs

    def execute_settings(self, graph: OpGraph, settings: TFSettings | None = None,
                         inputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Run once as plain TensorFlow at ``settings`` (default: TF's own) and return the outputs."""
        _, outs = self._call(graph, settings or tf_default(), inputs=inputs, placement={}, after={},
                             return_outputs=True)
        return outs

    def time_plan(self, graph: OpGraph, plan: Plan, repeats: int = 10, warmup: int = 2,
                  inputs: Sequence[np.ndarray] | None = None) -> list[float]:
        """Wall seconds per inference under ``plan`` (untraced, timed inside the worker
        around the session call, so no inter-process transfer is counted): the
        figure comparable with :meth:`measure`."""
        settings, placement, after = self._plan_args(graph, plan)
        reply, _ = self._call(graph, settings, inputs=inputs, placement=placement, after=after,
                              warmup=warmup, repeats=repeats)
        return [float(x) for x in reply["wall_s"]]

    def measure(self, graph: OpGraph, settings: TFSettings, repeats: int = 10, warmup: int = 2,
                inputs: Sequence[np.ndarray] | None = None) -> list[float]:
        """Wall seconds per inference of plain TensorFlow at ``settings`` (TF's own
        placement and order, no plan): what a user gets from these two knobs."""
        reply, _ = self._call(graph, settings, inputs=inputs, warmup=warmup, repeats=repeats)
        return [float(x) for x in reply["wall_s"]]

    def step_stats(self, graph: OpGraph, settings: TFSettings, runs: int, warmup: int = 2,
                   after: Mapping[str, Sequence[str]] | None = None) -> list[list[list[Any]]]:
        """Raw step stats of ``runs`` traced runs: per run ``[node, op type, start_ns, end_ns, device]``."""
        reply, _ = self._call(graph, settings, after=after, warmup=warmup, trace_runs=runs)
        return reply["traces"]

    def forget(self, graph: OpGraph) -> None:
        """Free ``graph`` (its GraphDef and sessions) in every worker."""
        key = self._graph_key(graph)
        for w in self._workers.values():
            if key in w.loaded and w.alive():
                w.request({"cmd": "unload", "key": key}, timeout_s=self.timeout_s)
                w.loaded.discard(key)

    def worker_pid(self, settings: TFSettings) -> int:
        """The process id of the worker for ``settings`` (started if needed)."""
        return self._worker(settings).pid

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return [w.pid for w in self._workers.values() if w.alive()]

    def close(self) -> None:
        """Stop every worker process (idempotent)."""
        self._closed = True
        self._finalizer()


def _source(graph: OpGraph) -> Any:
    from opsched.importers.tf_graph import TFSource

    src = graph.source
    if not isinstance(src, TFSource):
        kind = "was imported from PyTorch" if type(src).__name__ == "TorchSource" else "has no executable source"
        raise ExecutionError(f"graph {graph.name!r} {kind}, not from TensorFlow: the tf backend runs "
                             "graphs imported from Keras (a keras:NAME spec, a .py factory returning a Keras "
                             "model, or opsched.importers.tf_graph.from_keras / from_tf_function)")
    return src


# ------------------------------------------------------- step stats -> trace
def _match(graph: OpGraph, raw: Sequence[Sequence[Any]]) -> tuple[dict[str, tuple[int, int]], dict[str, Any]]:
    """Step-stats nodes that are ops of ``graph`` -> (start_ns, end_ns); the rest summarised."""
    timed: dict[str, tuple[int, int]] = {}
    untracked_ns = 0
    untracked_types: Counter[str] = Counter()
    ids = graph.index
    for node, op_type, start, end, _dev in raw:
        if op_type in _PLUMBING or node.startswith("_"):
            continue
        if node in ids:
            s, e = timed.get(node, (start, end))
            timed[node] = (min(s, start), max(e, end))
        else:
            untracked_ns += end - start
            untracked_types[op_type] += 1
    return timed, {"untracked_s": untracked_ns * 1e-9, "untracked_types": dict(untracked_types)}


def build_events(graph: OpGraph, plan: Plan, raw: Sequence[Sequence[Any]],
                 machine: Machine) -> tuple[list[TraceEvent], dict[str, Any]]:
    """Turn one traced run's step stats into one TraceEvent per op (seconds from the first op's start).

    Ops that Grappler fused into a later kernel get a model-proportional slice of
    that kernel's interval (zero-length at their inputs' end if a slice would
    break a dependency or a slot); see the module docstring.
    """
    from opsched.engine.models.analytic import default_model

    timed_ns, meta = _match(graph, raw)
    if not timed_ns:
        raise ExecutionError(f"graph {graph.name!r}: TensorFlow's step stats name none of its ops")
    t0 = min(s for s, _ in timed_ns.values())
    n = len(graph.ops)
    timed = {graph.index[k]: ((s - t0) * 1e-9, (e - t0) * 1e-9) for k, (s, e) in timed_ns.items()}
    model = default_model()
    weight = [model.op_time(op, machine.device(plan[op.id].device), plan[op.id].threads) for op in graph.ops]
    # A vanished op's host: the timed op it feeds that started first (through other vanished ops).
    host = [-1] * n
    for i in reversed(graph.topo_index):
        if i in timed:
            host[i] = i
            continue
        cands = [host[j] for j in graph.succ_index[i] if host[j] >= 0]
        host[i] = min(cands, key=lambda h: timed[h][0]) if cands else -1
    groups: dict[int, list[int]] = {}
    for i in graph.topo_index:
        if i not in timed and host[i] >= 0:
            groups.setdefault(host[i], []).append(i)
    iv = dict(timed)
    for h, members in groups.items():
        _slice(iv, h, members, weight)
    mode = "split"
    if groups and _violations(graph, plan, iv, machine):
        iv = dict(timed)
        mode = "zero-length"
    after = {graph.index[op.id]: [graph.index[d] for d in plan[op.id].after] for op in graph.ops}
    for i in graph.topo_index:  # zero-length events for what is still missing
        if i not in iv:
            deps = list(graph.pred_index[i]) + after.get(i, [])
            t = max((iv[p][1] for p in deps if p in iv), default=0.0)
            iv[i] = (t, t)
    events = [TraceEvent(op.id, iv[i][0], iv[i][1], plan[op.id].device, plan[op.id].threads)
              for i, op in enumerate(graph.ops)]
    vanished = [graph.ops[i].id for i in range(n) if i not in timed]
    meta.update({
        "span_s": max(e for _, e in iv.values()),
        "fused": {graph.ops[i].id: (graph.ops[host[i]].id if host[i] >= 0 else None) for i in range(n)
                  if i not in timed},
        "fused_attribution": mode if vanished else "none",
        "violations": _violations(graph, plan, iv, machine),
    })
    return events, meta


def _slice(iv: dict[int, tuple[float, float]], host: int, members: list[int], weight: Sequence[float]) -> None:
    s, e = iv[host]
    seq = [*members, host]
    w = np.array([max(weight[i], 1e-12) for i in seq])
    bounds = s + (e - s) * np.concatenate([[0.0], np.cumsum(w) / w.sum()])
    for k, i in enumerate(seq):
        iv[i] = (float(bounds[k]), float(bounds[k + 1]))
    iv[host] = (iv[host][0], e)


def _violations(graph: OpGraph, plan: Plan, iv: Mapping[int, tuple[float, float]], machine: Machine) -> int:
    """How many dependency or slot-capacity breaches the intervals contain (0 = a valid trace)."""
    bad = 0
    for i, op in enumerate(graph.ops):
        if i not in iv:
            continue
        deps = list(graph.pred_index[i]) + [graph.index[d] for d in plan[op.id].after]
        if any(p in iv and iv[i][0] < iv[p][1] for p in deps):
            bad += 1
    for dev in machine.devices:
        points = sorted([(iv[i][1], 0, -plan[op.id].threads) for i, op in enumerate(graph.ops)
                         if i in iv and plan[op.id].device == dev.id]
                        + [(iv[i][0], 1, plan[op.id].threads) for i, op in enumerate(graph.ops)
                           if i in iv and plan[op.id].device == dev.id])
        load = 0
        for _, _, d in points:
            load += d
            if load > dev.cores:
                bad += 1
    return bad


# ------------------------------------------------------------------ profile
def profile_tf(graph: OpGraph, machine: Machine | None = None, levels: Sequence[int] | None = None,
               runs: int = 10, warmup: int = 2, backend: TFBackend | None = None) -> Any:
    """Per-op times of a TF graph at each intra-op thread count, as an
    ``opsched.engine.profiles.Profile`` (the format the torch profiler writes
    and the fitted performance model reads).

    For each level ``k`` a worker with ``inter=1, intra=k`` runs the graph
    ``runs`` times under ``FULL_TRACE``; with one inter-op thread TF runs one
    op at a time, so each op's step-stats duration is its time alone at ``k``
    threads - one sample per run.  Ops Grappler fused into a later kernel get
    their model-proportional share of it (``settings['fused']`` lists them).
    """
    from opsched.engine.profiles import OpProfile, Profile
    from opsched.plan import uniform_plan

    machine = machine or Machine.probe()
    cpu = machine.cpu
    levels = tuple(sorted(set(levels or cpu.thread_levels())))
    if not levels or min(levels) < 1 or max(levels) > cpu.cores:
        raise PlanError(f"profile_tf: thread levels {levels} must lie in 1..{cpu.cores}")
    if runs < 1:
        raise PlanError(f"profile_tf: runs must be >= 1, got {runs}")
    own = backend is None
    be = backend or TFBackend(machine)
    samples: dict[str, dict[int, list[float]]] = {op.id: {} for op in graph.ops}
    fused: dict[str, Any] = {}
    try:
        for k in levels:
            plan = uniform_plan(graph, machine, k)
            for raw in be.step_stats(graph, TFSettings(1, k), runs=runs, warmup=warmup):
                events, meta = build_events(graph, plan, raw, machine)
                fused.update(meta["fused"])
                for e in events:
                    samples[e.op].setdefault(k, []).append(max(e.duration, 1e-9))
    finally:
        if own:
            be.close()
    from dataclasses import asdict

    ops = {op.id: OpProfile(op.id, op.kind, float(op.flops), float(op.bytes_total), tuple(op.shape),
                            {k: tuple(v) for k, v in samples[op.id].items()}) for op in graph.ops}
    import tensorflow as tf

    return Profile(graph.fingerprint(), graph.name, machine.fingerprint(), machine.name, asdict(cpu), levels, ops,
                   None, {"backend": "tf", "tf_version": tf.__version__, "runs": runs, "warmup": warmup,
                          "inter_op": 1, "fused": fused})
