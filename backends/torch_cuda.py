"""The PyTorch CUDA runtime: a Plan on GPUs (and the CPU), Nimble-style multi-stream.

``TorchCUDABackend(machine).run(graph, plan)`` executes an imported torch graph
(``graph.source``, a :class:`~opsched.importers.torch_fx.TorchSource`) with
each op on the device its plan names - ``gpu:i`` is ``cuda:i``, ``cpu`` the
host - and returns a measured :class:`~opsched.trace.Trace`; ``execute``
returns the model's outputs instead.

How (Nimble, Kwon et al. NeurIPS'20: schedule ahead of time, run the ops of
one GPU on several CUDA streams, synchronise streams with events only where
the graph needs it):

* **Compile once** (:func:`compile_streams`, pure Python, tested without a
  GPU).  The plan becomes a static *issue order*: list scheduling by the
  plan's priority (ties: graph order) over ops whose dependencies (data and
  ``after``) were issued.  A CPU op that waits for a GPU result is deferred
  while GPU ops can still be issued, so the host queues GPU work before it
  blocks.  Each GPU op gets one of its device's ``cores`` worker streams:
  ``"affinity"`` (default) continues the stream of a predecessor that is that
  stream's last op (a chain stays on one stream, no event needed) and
  otherwise takes the least recently used stream, which for independent ops
  is plain round-robin; ``"round-robin"`` rotates strictly.  Every
  dependency that stream order does not already imply becomes an event wait;
  vector clocks over the streams drop waits implied by earlier ones.
* **Copies.**  A value produced on one device and read on another is moved
  by an explicit copy inserted at compile time, issued right after its
  producer (once per destination device), on per-GPU copy streams: a
  GPU->GPU copy with the source's copy-out stream and the destination's
  copy-in stream current (torch copies on one of them; both first wait for
  the producer's event), a GPU->CPU copy on the source's copy-out stream, a
  CPU->GPU copy on the destination's copy-in stream; readers wait on the
  copy's event.  ``.to(device, non_blocking=True)`` throughout: a GPU->CPU
  copy lands in pinned host memory (what PyTorch does for a non-blocking
  device-to-host copy) and the host waits on its event before a CPU op reads
  it.  CPU->GPU copies are not pinned on the fly (PyTorch's guide to
  ``pin_memory``: pinning a tensor just to copy it once costs more than it
  saves); pass pinned inputs to make input transfers asynchronous.  A value
  changed in place is copied per reader, from the device of the last
  in-place change that reader depends on, so no reader sees a stale copy.
* **Run.**  One host thread walks the issue order: for a GPU op it makes the
  op's stream current on its device, enqueues the event waits, calls the op
  (kernels are queued asynchronously) and records the op's event; a CPU op
  runs on the host thread at its plan thread count once the events of its
  GPU inputs have completed (CPU ops of a mixed plan never co-run with each
  other).  The module's parameters and buffers are replicated once per
  device (cached); each device has its own value list.
* **Memory.**  Intermediate values are dropped after their last use (as eager
  code does).  A tensor read on a stream other than the one it was allocated
  on is marked with ``Tensor.record_stream`` so the caching allocator does
  not hand its memory out again before that stream is done with it.
* **Timing.**  With ``run``, each GPU op is bracketed by timing events on its
  stream, relative to a start event per GPU; CPU ops use ``perf_counter``
  relative to the host time the start events completed.  GPU and host clocks
  are aligned to within ``meta['clock_skew_bound_s']`` (half the time the
  start-event synchronisation took).  ``meta['wall_s']`` is the host wall time
  from the start events to the final synchronisation.  ``execute`` records no
  timing events.
* **CUDA graphs** (Nimble's other half): :meth:`TorchCUDABackend.capture`
  captures the same multi-stream schedule of a single-GPU plan into a CUDA
  graph once (fork/join events to the capture stream) and replays it with
  one launch, which removes the per-op Python launch cost that otherwise
  bounds small-batch GPU inference.

What differs from the plan semantics of ``opsched/plan.py``: dispatch happens
at issue time, not when a slot frees - an op queued on a stream behind
another starts when that one ends, even if another stream of the device is
idle by then (a static, ahead-of-time stream assignment, as in Nimble).

Errors: no CUDA, or a plan placing an op on ``gpu:i`` that this process
cannot see, raises :class:`~opsched.errors.ExecutionError` /
:class:`~opsched.errors.PlanError` naming it.  An op that raises while being
queued fails the run with :class:`ExecutionError` naming the op, after the
devices have drained; an error inside a CUDA kernel surfaces asynchronously
at the next synchronisation (run with ``CUDA_LAUNCH_BLOCKING=1`` to pin it to
its op).

``emulate=True`` runs this code path with every device mapped to the host
CPU and host-side stand-ins for streams and events: it executes the compiled
schedule's bookkeeping (replicas, per-device values, copies, drops, outputs,
traces) on a machine without CUDA, for tests.  It measures nothing about GPUs.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from time import perf_counter
from typing import Any

import torch

from opsched.backends.base import BackendBase
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace, TraceEvent

STREAM_POLICIES = ("affinity", "round-robin")
HOST = "host"


def torch_device_name(device_id: str) -> str:
    """The torch device of a plan device id: ``cpu`` -> ``cpu``, ``gpu:i`` -> ``cuda:i``."""
    if device_id == "cpu":
        return "cpu"
    if device_id.startswith("gpu:") and device_id[4:].isdigit():
        return f"cuda:{int(device_id[4:])}"
    raise PlanError(f"device {device_id!r} is neither 'cpu' nor 'gpu:<index>'")


def _is_gpu(device_id: str) -> bool:
    return device_id != "cpu"


# =====================================================================
# Compilation (pure Python: no CUDA needed, tested on CPU)
# =====================================================================
@dataclass(frozen=True)
class CopyStep:
    """Move value slot ``slot`` from device ``src`` to device ``dst``.

    A GPU source waits for the done events of ``src_waits`` (op indices: the
    producer, plus - for a value mutated in place - the reader's own
    dependencies on ``src``) before copying.  Event id of the copy: ``n + index``.
    """

    slot: int
    src: str
    dst: str
    src_waits: tuple[int, ...]


@dataclass(frozen=True)
class OpStep:
    """One step of the issue order: op ``op`` on ``device`` (stream ``stream``,
    -1 on the CPU), with the copies issued right before and after it.

    ``waits``: event ids its stream waits on before it (on the CPU: events the
    host synchronises on); ``reads_copies``: the copies whose results it reads;
    ``record_streams``: slots it reads that were
    allocated on another stream (``Tensor.record_stream`` on its stream);
    ``drops``: ``(device, slot)`` values released after this step.
    """

    op: int
    device: str
    stream: int
    waits: tuple[int, ...]
    copies_before: tuple[int, ...]
    copies_after: tuple[int, ...]
    reads_copies: tuple[int, ...]
    record_streams: tuple[int, ...]
    drops: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StreamSchedule:
    """A plan compiled for multi-stream execution (see the module docstring).

    Event ids: ``0..n-1`` are ops (recorded on the op's stream after it),
    ``n + c`` copy ``c`` (recorded on the copy-in stream of a GPU destination,
    on the copy-out stream of the source GPU for a CPU destination).
    ``copy_waits[c]`` lists the events each stream taking part in copy ``c``
    waits on (``(stream key, event id)``, in order).  Stream keys: ``"<dev>/w<k>"``
    worker ``k``, ``"<dev>/in"``, ``"<dev>/out"``, and ``"host"``.
    """

    n: int
    op_ids: tuple[str, ...]
    steps: tuple[OpStep, ...]
    copies: tuple[CopyStep, ...]
    copy_waits: tuple[tuple[tuple[str, int], ...], ...]
    needs_event: frozenset[int]
    streams: dict[str, int]
    devices: tuple[str, ...]
    slot_home: dict[int, str]
    input_devices: dict[int, tuple[str, ...]]
    stream_policy: str

    @property
    def order(self) -> list[int]:
        """Op indices in issue order."""
        return [s.op for s in self.steps]

    def step_of(self) -> dict[int, OpStep]:
        return {s.op: s for s in self.steps}

    def stream_key(self, op: int) -> str:
        st = self.step_of()[op]
        return HOST if st.stream < 0 else f"{st.device}/w{st.stream}"

    @property
    def n_waits(self) -> int:
        """Event waits in one run (stream waits and host synchronisations, copies included)."""
        return sum(len(s.waits) for s in self.steps) + sum(len(w) for w in self.copy_waits)


def default_slots(graph: OpGraph) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """A slot layout for a graph without a torch source: op ``i`` writes slot
    ``i`` and reads the slots of its data predecessors (edges with bytes)."""
    writes = [(i,) for i in range(len(graph.ops))]
    reads: list[list[int]] = [[] for _ in graph.ops]
    for (p, j), b in graph.edge_bytes.items():
        if b > 0:
            reads[j].append(p)
    return [tuple(sorted(r)) for r in reads], writes


def issue_order(graph: OpGraph, plan: Plan) -> list[int]:
    """The static issue order: list scheduling by the plan's dispatch rank over
    ops whose dependencies were issued; a CPU op with a GPU dependency waits
    while a GPU op can be issued (the host queues GPU work before it blocks)."""
    n = len(graph.ops)
    deps = _deps(graph, plan)
    dev = [plan[op.id].device for op in graph.ops]
    rank = [0] * n
    by_rank = plan.dispatch_order(graph)
    for r, i in enumerate(by_rank):
        rank[i] = r
    blocks = [not _is_gpu(dev[j]) and any(_is_gpu(dev[p]) for p in deps[j]) for j in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for j, d in enumerate(deps):
        for p in d:
            succs[p].append(j)
    left = [len(d) for d in deps]
    ready_gpu: list[int] = []
    ready_cpu: list[int] = []
    for j in range(n):
        if not left[j]:
            heappush(ready_gpu if _is_gpu(dev[j]) else ready_cpu, rank[j])
    order: list[int] = []
    while ready_gpu or ready_cpu:
        take_cpu = bool(ready_cpu) and (not ready_gpu or (
            ready_cpu[0] < ready_gpu[0] and not blocks[by_rank[ready_cpu[0]]]))
        j = by_rank[heappop(ready_cpu if take_cpu else ready_gpu)]
        order.append(j)
        for s in succs[j]:
            left[s] -= 1
            if not left[s]:
                heappush(ready_gpu if _is_gpu(dev[s]) else ready_cpu, rank[s])
    if len(order) != n:
        raise PlanError(f"plan for graph {graph.name!r}: its dependencies deadlock ({n - len(order)} op(s) never ready)")
    return order


def _deps(graph: OpGraph, plan: Plan) -> list[tuple[int, ...]]:
    index = graph.index
    return [
        tuple(sorted(set(graph.pred_index[i]) | {index[d] for d in plan[op.id].after if d != op.id}))
        for i, op in enumerate(graph.ops)
    ]


class _Clocks:
    """Vector clocks over streams: what each stream (and the host) knows has completed.

    ``issue(stream, ev)`` places an item on a stream; ``wait(stream, ev)``
    makes the stream wait for an item's event unless it already knows it
    completed (returns whether a wait was needed)."""

    def __init__(self) -> None:
        self.clock: dict[str, dict[str, int]] = {}
        self.ev_clock: dict[int, dict[str, int]] = {}
        self.ev_at: dict[int, tuple[str, int]] = {}
        self.t = 0
        self.needed: set[int] = set()

    def of(self, stream: str) -> dict[str, int]:
        c = self.clock.get(stream)
        if c is None:
            c = self.clock[stream] = {}
        return c

    def merge(self, dst: str, src: dict[str, int]) -> None:
        c = self.of(dst)
        for k, v in src.items():
            if c.get(k, -1) < v:
                c[k] = v

    def knows(self, stream: str, ev: int) -> bool:
        s, pos = self.ev_at[ev]
        return self.of(stream).get(s, -1) >= pos

    def wait(self, stream: str, ev: int) -> bool:
        if self.knows(stream, ev):
            return False
        self.merge(stream, self.ev_clock[ev])
        self.needed.add(ev)
        return True

    def tick(self, stream: str) -> int:
        self.t += 1
        self.of(stream)[stream] = self.t
        return self.t

    def issue(self, stream: str, ev: int) -> None:
        if stream != HOST:  # anything the host has seen complete is complete
            self.merge(stream, self.of(HOST))
        pos = self.tick(stream)
        self.ev_at[ev] = (stream, pos)
        self.ev_clock[ev] = dict(self.of(stream))


def compile_streams(graph: OpGraph, plan: Plan, machine: Machine,
                    reads: Sequence[Sequence[int]] | None = None, writes: Sequence[Sequence[int]] | None = None,
                    protected: Iterable[int] = (), mutable: Iterable[int] = (),
                    stream_policy: str = "affinity",
                    mutators: Mapping[int, Iterable[int]] | None = None) -> StreamSchedule:
    """Compile ``plan`` into a :class:`StreamSchedule` (see the module docstring).

    ``reads[i]`` / ``writes[i]``: the value slots op ``i`` reads and writes
    (default :func:`default_slots`); slots nobody writes are graph inputs or
    constants, present on every device that reads them.  ``protected`` slots
    (inputs, constants, outputs) are never dropped; ``mutable`` slots (values
    some op changes in place, and their aliases) are copied per reader;
    ``mutators[s]`` are the ops that change slot ``s`` in place: a reader sees
    the version of the last of them it depends on (the importer orders every
    reader before or after each in-place op), which lives on that op's device.
    """
    if stream_policy not in STREAM_POLICIES:
        raise PlanError(f"unknown stream policy {stream_policy!r}; choose from {', '.join(STREAM_POLICIES)}")
    plan.validate(graph, machine)
    if reads is None or writes is None:
        reads, writes = default_slots(graph)
    n = len(graph.ops)
    protected = set(protected)
    muts = {s: tuple(v) for s, v in (mutators or {}).items()}
    mutable = set(mutable) | set(muts)
    dev = [plan[op.id].device for op in graph.ops]
    deps = _deps(graph, plan)
    order = issue_order(graph, plan)
    pos = {j: t for t, j in enumerate(order)}
    writer: dict[int, int] = {}
    for i, ws in enumerate(writes):
        for s in ws:
            writer[s] = i
    slot_home = {s: dev[i] for s, i in writer.items()}
    for s, ms in muts.items():  # a value changed in place ends where its last change ran
        if ms:
            slot_home[s] = dev[max(ms, key=pos.__getitem__)]
    input_devices: dict[int, set[str]] = {}
    for j, rs in enumerate(reads):
        for s in rs:
            if s not in writer:
                input_devices.setdefault(s, set()).add(dev[j])

    # --- streams
    stream_of = [-1] * n
    tails: dict[str, list[int]] = {}
    last_use: dict[str, list[int]] = {}
    turn: dict[str, int] = {}
    for t, j in enumerate(order):
        d = dev[j]
        if not _is_gpu(d):
            continue
        k = machine.device(d).cores
        tail = tails.setdefault(d, [-1] * k)
        used = last_use.setdefault(d, [-1] * k)
        if stream_policy == "round-robin":
            s = turn.get(d, 0) % k
            turn[d] = s + 1
        else:
            mine = set(deps[j])
            cont = [s for s in range(k) if tail[s] in mine]
            s = max(cont, key=lambda x: used[x]) if cont else min(range(k), key=lambda x: (used[x], x))
        stream_of[j] = s
        tail[s] = j
        used[s] = t

    # --- copies: one per (slot, destination device); per reader for mutable slots
    copies: list[CopyStep] = []
    before: list[list[int]] = [[] for _ in range(n)]
    after: list[list[int]] = [[] for _ in range(n)]
    copy_of: dict[tuple[int, str], int] = {}  # (slot, dst) -> copy index (shared copies)
    reads_copy: list[dict[int, int]] = [{} for _ in range(n)]  # j -> {slot: copy index}
    for j in order:
        for s in reads[j]:
            p = _version_writer(j, s, writer, muts, deps, pos)
            if p is None or dev[p] == dev[j]:
                continue
            if s in mutable:
                waits = tuple(sorted({p} | {q for q in deps[j] if dev[q] == dev[p]}))
                c = len(copies)
                copies.append(CopyStep(s, dev[p], dev[j], waits))
                before[j].append(c)
            else:
                c = copy_of.get((s, dev[j]))
                if c is None:
                    c = copy_of[(s, dev[j])] = len(copies)
                    copies.append(CopyStep(s, dev[p], dev[j], (p,)))
                    after[p].append(c)  # created at its first reader: after[p] is in first-reader order
            reads_copy[j][s] = c

    # --- events: vector clocks decide which waits are needed
    clocks = _Clocks()
    op_waits: list[list[int]] = [[] for _ in range(n)]
    copy_waits: list[list[tuple[str, int]]] = [[] for _ in copies]

    def stream_key(j: int) -> str:
        return f"{dev[j]}/w{stream_of[j]}" if _is_gpu(dev[j]) else HOST

    def issue_copy(c: int) -> None:
        cs = copies[c]
        ev = n + c
        if not _is_gpu(cs.src):  # CPU -> GPU: the host produced the value already
            clocks.issue(f"{cs.dst}/in", ev)
            return
        out = f"{cs.src}/out"
        sides = [out] + ([f"{cs.dst}/in"] if _is_gpu(cs.dst) else [])
        for side in sides:
            if side != HOST:
                clocks.merge(side, clocks.of(HOST))
            for e in cs.src_waits:
                if clocks.wait(side, e):
                    copy_waits[c].append((side, e))
        # Whichever of the two current streams torch copies on, both waited for
        # the source, and the destination stream is ordered after the copy (the
        # contract of a non-blocking copy); nothing more is assumed.
        clocks.issue(sides[-1], ev)

    for j in order:
        for c in before[j]:
            issue_copy(c)
        sk = stream_key(j)
        if sk != HOST:
            clocks.merge(sk, clocks.of(HOST))
        cands = [n + c for c in reads_copy[j].values()]
        cands += [p for p in deps[j] if _is_gpu(dev[p])]
        for e in cands:
            if clocks.wait(sk, e):
                op_waits[j].append(e)
        clocks.issue(sk, j)
        for c in after[j]:
            issue_copy(c)

    # --- memory: record_stream for cross-stream reads, drops after the last use
    alloc_stream: dict[tuple[str, int], str] = {}
    for s, p in writer.items():
        alloc_stream[(dev[p], s)] = stream_key(p)
    for cs in copies:
        if _is_gpu(cs.dst):
            alloc_stream[(cs.dst, cs.slot)] = f"{cs.dst}/in"
    rec: list[list[int]] = [[] for _ in range(n)]
    for j in range(n):
        if not _is_gpu(dev[j]):
            continue
        for s in reads[j]:
            home = alloc_stream.get((dev[j], s))
            if s not in protected and home is not None and home != stream_key(j):
                rec[j].append(s)
    last: dict[tuple[str, int], int] = {}

    def use(d: str, s: int, j: int) -> None:
        if s in protected:
            return
        cur = last.get((d, s))
        if cur is None or pos[j] > pos[cur]:
            last[(d, s)] = j

    for j in range(n):
        for s in writes[j]:
            use(dev[j], s, j)
        for s in reads[j]:
            use(dev[j], s, j)
    for j in range(n):
        for c in before[j] + after[j]:
            cs = copies[c]
            use(cs.src, cs.slot, j)
            use(cs.dst, cs.slot, j)
    drops: list[list[tuple[str, int]]] = [[] for _ in range(n)]
    for (d, s), j in last.items():
        drops[j].append((d, s))

    steps = tuple(
        OpStep(j, dev[j], stream_of[j], tuple(op_waits[j]), tuple(before[j]), tuple(after[j]),
               tuple(sorted(reads_copy[j].values())), tuple(sorted(set(rec[j]))), tuple(sorted(drops[j])))
        for j in order
    )
    streams = {d: 1 + max(stream_of[j] for j in range(n) if dev[j] == d) for d in sorted(set(dev)) if _is_gpu(d)}
    for cs in copies:
        for d in (cs.src, cs.dst):
            if _is_gpu(d):
                streams.setdefault(d, 0)
    devices = tuple(sorted(set(dev) | {cs.dst for cs in copies}))
    return StreamSchedule(
        n, tuple(op.id for op in graph.ops), steps, tuple(copies), tuple(tuple(w) for w in copy_waits),
        frozenset(clocks.needed), streams, devices, slot_home,
        {s: tuple(sorted(v)) for s, v in input_devices.items()}, stream_policy,
    )




def _version_writer(j: int, s: int, writer: Mapping[int, int], mutators: Mapping[int, Sequence[int]],
                    deps: Sequence[Sequence[int]], pos: Mapping[int, int]) -> int | None:
    """The op whose version of slot ``s`` op ``j`` reads: the last in-place
    changer of ``s`` that ``j`` depends on, else its producer (None: an input)."""
    ms = mutators.get(s)
    if ms:
        mine = [m for m in ms if m != j and m in deps[j]]
        if mine:
            return max(mine, key=pos.__getitem__)
    return writer.get(s)


def happens_before_violations(graph: OpGraph, plan: Plan, sched: StreamSchedule,
                              reads: Sequence[Sequence[int]] | None = None,
                              writes: Sequence[Sequence[int]] | None = None,
                              mutators: Mapping[int, Sequence[int]] | None = None) -> list[str]:
    """What the compiled schedule fails to enforce (empty: it is safe).

    An independent check of :func:`compile_streams`: it builds the
    happens-before graph of the schedule as CUDA executes it - stream order,
    event waits, host order (the host issues a GPU item only after every host
    item before it finished) and, for a copy, only what torch promises: it
    is ordered after the work already queued on the current stream of the
    device it runs on (for a GPU-to-GPU copy either device's, so both must
    have waited for the source) and the destination's current stream is
    ordered after it - and checks that every op follows each dependency (data
    and ``after``), that every value an op reads from another device reaches
    it through a copy to its device that precedes it, and that every copy
    follows the ops it waits for.  ``mutators`` as for :func:`compile_streams`: a
    reader must get the version of the last in-place change it depends on."""
    if reads is None or writes is None:
        reads, writes = default_slots(graph)
    mutators = mutators or {}
    n = sched.n
    preds: dict[tuple, list[tuple]] = {}
    tails: dict[str, tuple] = {}
    done: dict[int, tuple] = {}
    last_host: list[tuple] = []

    def add(node: tuple, stream: str, waits: Iterable[int] = (), extra: Iterable[tuple] = ()) -> None:
        pre = [done[e] for e in waits] + list(extra)
        if stream in tails:
            pre.append(tails[stream])
        if stream != HOST and last_host:
            pre.append(last_host[-1])
        preds[node] = pre
        tails[stream] = node
        if stream == HOST:
            last_host.append(node)

    def copy(c: int) -> None:
        cs = sched.copies[c]
        w: dict[str, list[int]] = {}
        for side, e in sched.copy_waits[c]:
            w.setdefault(side, []).append(e)
        if not _is_gpu(cs.src):
            add(("copy", c), f"{cs.dst}/in")
            done[n + c] = ("copy", c)
        elif _is_gpu(cs.dst):
            inn, out = f"{cs.dst}/in", f"{cs.src}/out"
            add(("copy-src", c), out, w.get(out, ()))
            add(("copy", c), inn, w.get(inn, ()))
            done[n + c] = ("copy", c)
        else:
            add(("copy", c), f"{cs.src}/out", w.get(f"{cs.src}/out", ()))
            done[n + c] = ("copy", c)

    for st in sched.steps:
        for c in st.copies_before:
            copy(c)
        add(("op", st.op), HOST if st.stream < 0 else f"{st.device}/w{st.stream}", st.waits)
        done[st.op] = ("op", st.op)
        for c in st.copies_after:
            copy(c)

    # Ancestor sets as int bitmasks, in creation order (a node's predecessors always exist before it).
    bit = {node: 1 << k for k, node in enumerate(preds)}
    anc_mask: dict[tuple, int] = {}
    for node, pre in preds.items():
        m = 0
        for p in pre:
            m |= anc_mask[p] | bit[p]
        anc_mask[node] = m

    def before(a: tuple, b: tuple) -> bool:
        return bool(anc_mask[b] & bit[a])

    problems: list[str] = []
    ids = [op.id for op in graph.ops]
    deps = _deps(graph, plan)
    writer = {s: i for i, ws in enumerate(writes) for s in ws}
    dev = {st.op: st.device for st in sched.steps}
    pos = {st.op: k for k, st in enumerate(sched.steps)}
    if sorted(dev) != list(range(n)):
        problems.append("the issue order does not list every op exactly once")
    for st in sched.steps:
        j = st.op
        for p in deps[j]:
            if not before(("op", p), ("op", j)):
                problems.append(f"op {ids[j]!r} may start before its dependency {ids[p]!r} ends")
        for s in reads[j]:
            p = _version_writer(j, s, writer, mutators, deps, pos)
            if p is None or dev[p] == st.device:
                continue
            got = [c for c in st.reads_copies if sched.copies[c].slot == s and sched.copies[c].dst == st.device
                   and sched.copies[c].src == dev[p] and p in sched.copies[c].src_waits]
            if not got:
                problems.append(f"op {ids[j]!r} on {st.device} reads slot {s} of {ids[p]!r} on {dev[p]} "
                                "with no copy")
            elif not any(before(done[n + c], ("op", j)) for c in got):
                problems.append(f"op {ids[j]!r} may read slot {s} before its copy lands")
    for c, cs in enumerate(sched.copies):
        sides = [("copy-src", c), ("copy", c)] if ("copy-src", c) in bit else [("copy", c)]
        for p in cs.src_waits:
            if not all(before(("op", p), node) for node in sides):
                problems.append(f"copy of slot {cs.slot} {cs.src}->{cs.dst} may start before op {ids[p]!r} ends")
    return problems


# =====================================================================
# Device API: real CUDA, or host stand-ins (emulate=True)
# =====================================================================
def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _move(value: Any, device: torch.device, non_blocking: bool = True, clone: bool = False) -> Any:
    """``value`` (a tensor, or a tuple/list/dict of them) on ``device``; other
    values unchanged.  ``clone``: always a new tensor, even on the same device."""
    if isinstance(value, torch.Tensor):
        out = value.to(device, non_blocking=non_blocking)
        return out.clone() if clone and out is value else out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_move(v, device, non_blocking, clone) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device, non_blocking, clone) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device, non_blocking, clone) for k, v in value.items()}
    return value


class _CudaAPI:
    """The CUDA calls the runtime makes (one indirection, so tests can swap it)."""

    emulated = False

    def device(self, device_id: str) -> torch.device:
        return torch.device(torch_device_name(device_id))

    def move(self, value: Any, device_id: str) -> Any:
        """A copy of ``value`` on ``device_id`` (non-blocking; onto the current streams)."""
        return _move(value, self.device(device_id), non_blocking=True)

    def stream(self, device_id: str) -> Any:
        return torch.cuda.Stream(device=self.device(device_id))

    def event(self, timing: bool) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def set_stream(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def current_stream(self, device_id: str) -> Any:
        return torch.cuda.current_stream(self.device(device_id))

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self, device_id: str) -> None:
        torch.cuda.synchronize(self.device(device_id))

    def elapsed_s(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3

    def record_stream(self, value: Any, stream: Any) -> None:
        for t in _tensors(value):
            if t.is_cuda:
                t.record_stream(stream)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)


class _HostStream:
    def __init__(self, device_id: str) -> None:
        self.device_id = device_id


class _HostEvent:
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0


class _EmulatedAPI(_CudaAPI):
    """Every device is the host CPU; work runs synchronously in issue order, so
    streams and waits are no-ops and an event is the host time it was recorded."""

    emulated = True

    def device(self, device_id: str) -> torch.device:
        torch_device_name(device_id)  # validates the id
        return torch.device("cpu")

    def move(self, value: Any, device_id: str) -> Any:
        # A real copy, as a transfer between devices makes one: a value changed
        # in place on one "device" must not change it on another.
        return _move(value, self.device(device_id), non_blocking=False, clone=True)

    def stream(self, device_id: str) -> Any:
        return _HostStream(device_id)

    def event(self, timing: bool) -> Any:
        return _HostEvent()

    def set_stream(self, stream: Any) -> None:
        return None

    def current_stream(self, device_id: str) -> Any:
        return _HostStream(device_id)

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def record(self, event: Any, stream: Any) -> None:
        event.t = perf_counter()

    def host_wait(self, event: Any) -> None:
        return None

    def synchronize(self, device_id: str) -> None:
        return None

    def elapsed_s(self, start: Any, end: Any) -> float:
        return end.t - start.t

    def record_stream(self, value: Any, stream: Any) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        return None


def visible_gpu_problems(graph: OpGraph, plan: Plan, visible: int) -> list[str]:
    """Ops placed on a ``gpu:i`` this process cannot see (``i >= visible``)."""
    out = []
    for op in graph.ops:
        d = plan[op.id].device
        if _is_gpu(d) and int(torch_device_name(d).split(":")[1]) >= visible:
            out.append(f"op {op.id!r} is placed on {d!r}")
    return out


# =====================================================================
# The backend
# =====================================================================
@dataclass
class _Replica:
    """The graph's source on one device: compiled op callables bound to that
    device's copy of the module, and its constants (parameters, buffers)."""

    source: Any
    fns: dict[str, Any]
    consts: list[tuple[int, Any]]


@dataclass(eq=False)
class _Compiled:
    """A plan compiled for this backend: the schedule plus everything resolved
    once - callables per op on its device, streams per step, events."""

    graph: OpGraph
    plan: Plan
    sched: StreamSchedule
    fns: list[Any]
    replicas: dict[str, _Replica]
    input_slots: tuple[int, ...]
    output_slots: list[int]
    threads: list[int]
    n_slots: int = 0
    reads: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    writes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    mutators: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    step_streams: list[Any] = dataclasses.field(default_factory=list)
    copy_sides: list[tuple[tuple[Any, int], ...]] = dataclasses.field(default_factory=list)
    #: timing? -> (op/copy done events, op start events)
    events: dict[bool, tuple[list[Any], list[Any]]] = dataclasses.field(default_factory=dict)
    lock: Any = dataclasses.field(default_factory=threading.Lock)


class TorchCUDABackend(BackendBase):
    """Run imported PyTorch graphs on CUDA GPUs (and the CPU) under a Plan.

    Arguments:
        machine: the machine plans are made for; ``gpu:i`` is ``cuda:i`` and
            its ``cores`` is the number of worker streams.
        stream_policy: ``"affinity"`` (chains stay on their stream, otherwise
            least recently used) or ``"round-robin"``.
        free_values: drop intermediate values after their last use.
        cache_size: how many compiled (graph, plan) pairs to keep.
        emulate: run the GPU code path on the host CPU with stand-in streams
            and events (for testing without CUDA; measures nothing about GPUs).
    """

    name = "torch-cuda"
    measured = True

    def __init__(self, machine: Machine, stream_policy: str = "affinity", free_values: bool = True,
                 cache_size: int = 16, emulate: bool = False) -> None:
        super().__init__(machine)
        if stream_policy not in STREAM_POLICIES:
            raise ExecutionError(f"torch-cuda: unknown stream policy {stream_policy!r}; "
                                 f"choose from {', '.join(STREAM_POLICIES)}")
        if not emulate and not torch.cuda.is_available():
            built = f"torch {torch.__version__} " + (
                f"built with CUDA {torch.version.cuda}, but no CUDA device is visible "
                "(check the driver and CUDA_VISIBLE_DEVICES)"
                if torch.version.cuda else "is a CPU-only build (no CUDA support)")
            raise ExecutionError(f"the torch-cuda backend needs a CUDA GPU and there is none here: {built}; "
                                 "use the torch-cpu backend or the simulator on this machine")
        self.api: _CudaAPI = _EmulatedAPI() if emulate else _CudaAPI()
        self.emulated = emulate
        self.visible_gpus = len(machine.gpus) if emulate else torch.cuda.device_count()
        self.stream_policy = stream_policy
        self.free_values = free_values
        self._cache = IdentityLRU(max(1, cache_size))  # (graph, plan) -> _Compiled
        # Compiled plans hold their replicas; this cache only saves re-copying
        # parameters for the next plan of the same graph (least recently used dropped).
        self._replicas = IdentityLRU(2 * max(1, cache_size))  # (source, device) -> _Replica
        self._streams: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._closed = False

    # -------------------------------------------------------------- compile
    def compile(self, graph: OpGraph, plan: Plan) -> _Compiled:
        """Validate and compile ``plan`` for ``graph`` (cached by identity)."""
        if self._closed:
            raise ExecutionError(f"the {self.name} backend is closed; create a new one to run graph {graph.name!r}")
        with self._lock:
            return self._cache.get_or_make((id(graph), id(plan)), lambda: self._compile(graph, plan), graph, plan)

    def _compile(self, graph: OpGraph, plan: Plan) -> _Compiled:
        from opsched.backends.torch_cpu import _protected_slots, _torch_source
        from opsched.importers.torch_fx import output_slots

        plan.validate(graph, self.machine)
        bad = visible_gpu_problems(graph, plan, self.visible_gpus)
        if bad:
            raise PlanError(
                f"plan{' ' + repr(plan.policy) if plan.policy else ''} for graph {graph.name!r}: {bad[0]}"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                + f", but this process sees {self.visible_gpus} CUDA device(s)"
                + (f" (cuda:0..cuda:{self.visible_gpus - 1})" if self.visible_gpus else "")
                + "; check CUDA_VISIBLE_DEVICES or plan for the GPUs present")
        src = _torch_source(graph)
        index = graph.index
        base = src.compile_ops()
        reads: list[tuple[int, ...]] = [()] * len(graph.ops)
        writes: list[tuple[int, ...]] = [()] * len(graph.ops)
        for c in base:
            i = index.get(c.op_id)
            if i is None:
                raise ExecutionError(f"graph {graph.name!r}: its torch source has op {c.op_id!r}, "
                                     "which the graph lacks (graph and source do not match)")
            reads[i], writes[i] = tuple(c.reads), tuple(c.writes)
        if len({c.op_id for c in base}) != len(graph.ops):
            raise ExecutionError(f"graph {graph.name!r}: its torch source does not run every op "
                                 "(graph and source do not match)")
        protected = _protected_slots(src)
        if protected is None or not self.free_values:
            protected = set(range(src.n_slots))
        mutable, mutators = _mutable_slots(src, index)
        sched = compile_streams(graph, plan, self.machine, reads, writes, protected,
                                mutable, self.stream_policy, mutators)
        devices = sorted({plan[op.id].device for op in graph.ops} | set(sched.devices))
        replicas = {d: self._replica(src, d) for d in devices}
        fns = [replicas[plan[op.id].device].fns[op.id] for op in graph.ops]
        outputs = sorted(set(output_slots(src.output_spec)))
        threads = [plan[op.id].threads for op in graph.ops]
        cp = _Compiled(graph, plan, sched, fns, replicas, tuple(src.input_slots), outputs, threads)
        cp.n_slots = src.n_slots
        cp.reads, cp.writes, cp.mutators = reads, writes, mutators
        streams = {d: self._device_streams(d, k) for d, k in sched.streams.items()}
        # Resolved once, so the issue loop touches no dicts or strings per op.
        cp.step_streams = [streams[st.device][f"w{st.stream}"] if st.stream >= 0 else None for st in sched.steps]
        cp.copy_sides = [tuple((streams[side.split("/")[0]][side.split("/")[1]], e) for side, e in w)
                         for w in sched.copy_waits]
        return cp

    def _replica(self, src: Any, device_id: str) -> _Replica:
        """The source on ``device_id``: parameters and buffers copied there once (cached)."""
        key = (id(src), device_id)
        hit = self._replicas.get(key, src)
        if hit is not None:
            return hit
        from opsched.importers.torch_fx import _fetch_attr

        if device_id == "cpu" and not any(t.is_cuda for t in _params(src.gm)):
            rsrc = src
        else:
            gm = copy.deepcopy(src.gm).to(self.api.device(device_id))
            rsrc = dataclasses.replace(src, gm=gm, _compiled=None)
        fns = {c.op_id: c.run for c in rsrc.compile_ops()}
        consts = [(s, _fetch_attr(rsrc.gm, target)) for s, target in rsrc.const_slots.items()]
        rep = _Replica(rsrc, fns, consts)
        self._replicas.put(key, rep, src)
        return rep

    def _device_streams(self, device_id: str, workers: int) -> dict[str, Any]:
        """Worker streams ``w0..`` plus ``in`` / ``out`` copy streams of a GPU (created once)."""
        with self._lock:
            got = self._streams.setdefault(device_id, {})
            for key in [f"w{k}" for k in range(workers)] + ["in", "out"]:
                if key not in got:
                    got[key] = self.api.stream(device_id)
            return got

    # ------------------------------------------------------------------ run
    def run(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any] | None = None) -> Trace:
        """Execute ``plan`` on ``inputs`` (default: the graph's example inputs) and
        return the measured trace (per-op CUDA-event timings)."""
        cp = self.compile(graph, plan)
        src = graph.source
        _, timing = self._execute(cp, tuple(src.example_inputs if inputs is None else inputs), timing=True)
        assert timing is not None  # _execute(timing=True) returns the timing
        return self._trace(cp, timing)

    def execute(self, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> Any:
        """Execute ``plan`` on ``inputs`` and return the model's outputs (each
        on the device of the op that produced it; the devices have finished)."""
        cp = self.compile(graph, plan)
        values, _ = self._execute(cp, tuple(inputs), timing=False)
        return cp.graph.source.collect_output(values)

    def _events(self, cp: _Compiled, timing: bool) -> tuple[list[Any], list[Any]]:
        with cp.lock:
            hit = cp.events.get(timing)
            if hit is None:
                n, m = cp.sched.n, len(cp.sched.copies)
                done = [self.api.event(timing) for _ in range(n + m)]
                starts = [self.api.event(True) for _ in range(n)] if timing else []
                hit = cp.events[timing] = (done, starts)
            return hit

    def _execute(self, cp: _Compiled, inputs: tuple, timing: bool) -> tuple[list, dict | None]:
        if self._closed:
            raise ExecutionError(f"the {self.name} backend is closed; create a new one to run graph {cp.graph.name!r}")
        if len(inputs) != len(cp.input_slots):
            raise ExecutionError(f"graph {cp.graph.name!r}: expected {len(cp.input_slots)} inputs, got {len(inputs)}")
        with self._lock, torch.no_grad():
            return self._execute_locked(cp, inputs, timing)

    def _execute_locked(self, cp: _Compiled, inputs: tuple, timing: bool) -> tuple[list, dict | None]:
        api, sched = self.api, cp.sched
        gpus = [d for d in sched.devices if _is_gpu(d)]
        streams = {d: self._streams[d] for d in gpus}
        saved_streams = {d: api.current_stream(d) for d in gpus}
        saved_device = api.current_device() if gpus else None
        caller_threads = torch.get_num_threads()
        done, starts = self._events(cp, timing)
        values = {d: self._fresh_values(cp, d) for d in sched.devices}
        start_ev = {d: api.event(True) for d in gpus} if timing else {}
        host_times: dict[int, tuple[float, float]] = {}
        failed: BaseException | None = None
        failed_op = -1
        t_a = t_b = t0 = 0.0  # set in the try; read below only when it did not raise
        try:
            for d in gpus:
                api.synchronize(d)
            t_a = perf_counter()
            for d in gpus:
                if timing:
                    api.record(start_ev[d], streams[d]["in"])
            for d in gpus:
                if timing:
                    api.host_wait(start_ev[d])
            t_b = perf_counter()
            t0 = (t_a + t_b) / 2 if gpus else t_b
            self._place_inputs(cp, values, inputs, streams)
            for d in gpus:  # every stream of the device starts after the inputs landed
                ready = api.event(False)
                api.record(ready, streams[d]["in"])
                for key, s in streams[d].items():
                    if key != "in":
                        api.wait(s, ready)
            failed_op, failed = self._issue(cp, values, streams, done, starts, host_times)
        except BaseException as exc:  # noqa: BLE001 - drained and re-raised below
            failed = exc
        finally:
            drain_error = None
            for d in gpus:
                try:
                    api.synchronize(d)
                except BaseException as exc:  # noqa: BLE001
                    drain_error = drain_error or exc
            t_end = perf_counter()
            for d in gpus:
                api.set_stream(saved_streams[d])
            if saved_device is not None:
                api.set_device(saved_device)
            torch.set_num_threads(caller_threads)
        if failed is not None:
            if failed_op >= 0:
                op_id = cp.sched.op_ids[failed_op]
                raise ExecutionError(
                    f"graph {cp.graph.name!r}: op {op_id!r} on {cp.sched.step_of()[failed_op].device} raised "
                    f"{type(failed).__name__}: {failed} "
                    f"(fx nodes: {', '.join(cp.graph.source.op_nodes.get(op_id, ()))})"
                ) from failed
            if isinstance(failed, Exception) and not isinstance(failed, ExecutionError):
                raise ExecutionError(f"graph {cp.graph.name!r}: the {self.name} run failed: "
                                     f"{type(failed).__name__}: {failed}") from failed
            raise failed
        if drain_error is not None:
            raise ExecutionError(
                f"graph {cp.graph.name!r}: a CUDA error surfaced while the devices finished the run "
                f"({type(drain_error).__name__}: {drain_error}); kernels run asynchronously, so rerun with "
                "CUDA_LAUNCH_BLOCKING=1 to find the op") from drain_error
        merged = self._merge_outputs(cp, values, inputs)
        timing_out = None
        if timing:
            timing_out = {"t0": t0, "skew": (t_b - t_a) / 2, "wall": t_end - t0, "start": start_ev,
                          "starts": starts, "done": done, "host": host_times}
        return merged, timing_out

    def _fresh_values(self, cp: _Compiled, device_id: str) -> list:
        values: list = [None] * cp.n_slots
        for s, t in cp.replicas[device_id].consts:
            values[s] = t
        return values

    def _place_inputs(self, cp: _Compiled, values: dict[str, list], inputs: tuple,
                      streams: dict[str, dict[str, Any]]) -> None:
        """Graph inputs onto every device that reads them (GPU: on its copy-in stream)."""
        api = self.api
        for k, s in enumerate(cp.input_slots):
            x = inputs[k]
            for d in cp.sched.input_devices.get(s, ()):
                if _is_gpu(d):
                    api.set_stream(streams[d]["in"])
                    values[d][s] = api.move(x, d)
                else:
                    values[d][s] = _move(x, torch.device("cpu"), non_blocking=False)

    def _issue(self, cp: _Compiled, values: dict[str, list], streams: dict[str, dict[str, Any]],
               done: list[Any], starts: list[Any], host_times: dict[int, tuple[float, float]],
               manage_memory: bool = True) -> tuple[int, BaseException | None]:
        """Walk the issue order (see the module docstring).  Returns (op, error)
        of the first op that raised while being issued, or (-1, None).
        ``manage_memory=False`` (CUDA-graph capture) keeps every value and
        calls no ``record_stream``."""
        api, sched, fns, threads = self.api, cp.sched, cp.fns, cp.threads
        n = sched.n
        copies, copy_sides, step_streams = sched.copies, cp.copy_sides, cp.step_streams
        needs = sched.needs_event
        timing = bool(starts)
        drops = manage_memory and self.free_values

        def do_copy(c: int) -> None:
            cs = copies[c]
            x = values[cs.src][cs.slot]
            if not _is_gpu(cs.src):
                inn = streams[cs.dst]["in"]
                api.set_stream(inn)
                values[cs.dst][cs.slot] = api.move(x, cs.dst)
                api.record(done[n + c], inn)
                return
            out = streams[cs.src]["out"]
            for side, e in copy_sides[c]:
                api.wait(side, done[e])
            api.set_stream(out)
            if manage_memory:
                api.record_stream(x, out)
            if _is_gpu(cs.dst):
                inn = streams[cs.dst]["in"]
                api.set_stream(inn)
                values[cs.dst][cs.slot] = api.move(x, cs.dst)
                api.record(done[n + c], inn)
            else:
                values[cs.dst][cs.slot] = api.move(x, "cpu")
                api.record(done[n + c], out)

        for st, s in zip(sched.steps, step_streams, strict=True):
            j = st.op
            for c in st.copies_before:
                do_copy(c)
            vals = values[st.device]
            if s is not None:
                api.set_stream(s)
                for e in st.waits:
                    api.wait(s, done[e])
                if manage_memory:
                    for slot in st.record_streams:
                        api.record_stream(vals[slot], s)
                if timing:
                    api.record(starts[j], s)
                try:
                    fns[j](vals)
                except Exception as exc:  # noqa: BLE001 - reported with the op's name
                    return j, exc
                if timing or j in needs:
                    api.record(done[j], s)
            else:
                for e in st.waits:
                    api.host_wait(done[e])
                k = threads[j]
                if torch.get_num_threads() != k:
                    torch.set_num_threads(k)
                t_s = perf_counter()
                try:
                    fns[j](vals)
                except Exception as exc:  # noqa: BLE001
                    return j, exc
                host_times[j] = (t_s, perf_counter())
            for c in st.copies_after:
                do_copy(c)
            if drops:
                for dd, slot in st.drops:
                    values[dd][slot] = None
        return -1, None

    def _merge_outputs(self, cp: _Compiled, values: dict[str, list], inputs: tuple) -> list:
        """One slot list holding every output from the device that produced it."""
        merged: list = [None] * cp.n_slots
        home = cp.sched.slot_home
        first = cp.sched.devices[0]
        for s in cp.output_slots:
            d = home.get(s)
            if d is None:
                pos = cp.input_slots.index(s) if s in cp.input_slots else -1
                merged[s] = inputs[pos] if pos >= 0 else values[first][s]
            else:
                merged[s] = values[d][s]
                if _is_gpu(d) and not self.emulated:
                    # Allocated on a worker stream; the caller uses it on its own stream.
                    for t in _tensors(merged[s]):
                        if t.is_cuda:
                            t.record_stream(torch.cuda.current_stream(t.device))
        return merged

    def _trace(self, cp: _Compiled, timing: dict) -> Trace:
        api, sched = self.api, cp.sched
        t0 = timing["t0"]
        events = []
        for st in sched.steps:
            j = st.op
            if st.stream >= 0:
                start_ev = timing["start"][st.device]
                s = api.elapsed_s(start_ev, timing["starts"][j])
                e = api.elapsed_s(start_ev, timing["done"][j])
                if self.emulated:  # host events: place them on the host clock
                    base = start_ev.t - t0
                    s, e = s + base, e + base
                events.append(TraceEvent(sched.op_ids[j], s, max(e, s), st.device, 1, (st.stream,), st.stream))
            else:
                hs, he = timing["host"][j]
                k = cp.threads[j]
                events.append(TraceEvent(sched.op_ids[j], hs - t0, he - t0, "cpu", k, tuple(range(k)), 0))
        events.sort(key=lambda ev: (ev.start, ev.op))
        meta = {
            "wall_s": timing["wall"],
            "mode": "emulated" if self.emulated else "streams",
            "emulated": self.emulated,
            "stream_policy": sched.stream_policy,
            "streams": dict(sched.streams),
            "copies": [{"slot": c.slot, "src": c.src, "dst": c.dst} for c in sched.copies],
            "event_waits": sched.n_waits,
            "clock_skew_bound_s": timing["skew"],
            "plan": cp.plan.policy,
        }
        return Trace(tuple(events), backend=self.name, meta=meta)

    # --------------------------------------------------------- CUDA graphs
    def capture(self, graph: OpGraph, plan: Plan, *inputs: Any, warmup: int = 3) -> CapturedPlan:
        """Capture ``plan``'s multi-stream schedule into a CUDA graph (Nimble's
        ahead-of-time launch): every op must be on one GPU.  ``inputs`` give
        the shapes; :meth:`CapturedPlan.replay` runs it on new inputs."""
        cp = self.compile(graph, plan)
        devs = {plan[op.id].device for op in graph.ops}
        if len(devs) != 1 or not _is_gpu(next(iter(devs))):
            raise PlanError(f"plan for graph {graph.name!r}: CUDA-graph capture needs every op on one GPU, "
                            f"this plan uses {', '.join(sorted(devs))}")
        if self.emulated:
            raise ExecutionError("CUDA-graph capture needs a real GPU (this backend is emulated)")
        d = next(iter(devs))
        dev = self.api.device(d)
        static_in = tuple(_move(x, dev).clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        for _ in range(max(1, warmup)):  # initialises cuBLAS/cuDNN state on these streams before capture
            self._execute(cp, static_in, timing=False)
        done, _ = self._events(cp, False)
        streams = self._streams[d]
        with self._lock, torch.no_grad(), torch.cuda.device(dev):
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            cap = torch.cuda.Stream(device=dev)
            fork = torch.cuda.Event()
            joins = {k: torch.cuda.Event() for k in streams}
            values = {d: self._fresh_values(cp, d)}
            for k, s in enumerate(cp.input_slots):
                values[d][s] = static_in[k]
            saved = torch.cuda.current_stream(dev)
            try:
                with torch.cuda.graph(g, stream=cap):
                    # Fork: every stream joins the capture through an event of the capture stream ...
                    fork.record(cap)
                    for s in streams.values():
                        s.wait_event(fork)
                    op, err = self._issue(cp, values, {d: streams}, done, [], {}, manage_memory=False)
                    # ... and joins back before it ends, on the stream it began on.
                    for k, s in streams.items():
                        joins[k].record(s)
                        cap.wait_event(joins[k])
                    torch.cuda.set_stream(cap)
                    if err is not None:
                        raise ExecutionError(f"graph {graph.name!r}: op {cp.sched.op_ids[op]!r} raised during "
                                             f"CUDA-graph capture: {type(err).__name__}: {err}") from err
            finally:
                torch.cuda.set_stream(saved)
            outputs = graph.source.collect_output(self._merge_outputs(cp, values, static_in))
        return CapturedPlan(g, static_in, outputs, values, dev)

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Drop compiled plans, replicas and streams (idempotent)."""
        with self._lock:
            self._closed = True
            self._cache.clear()
            self._replicas.clear()
            self._streams.clear()


class CapturedPlan:
    """A plan captured into a CUDA graph: ``replay(*inputs)`` copies the inputs
    into the captured input buffers, launches the graph once and returns the
    captured outputs (overwritten by the next replay - clone them to keep them).
    The call returns once the work is queued; synchronise before timing."""

    def __init__(self, graph: Any, static_inputs: tuple, outputs: Any, values: dict, device: torch.device) -> None:
        self.graph = graph
        self.static_inputs = static_inputs
        self.outputs = outputs
        self._values = values  # keeps every captured tensor alive
        self.device = device

    def replay(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ExecutionError(f"captured plan takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        for buf, x in zip(self.static_inputs, inputs, strict=True):
            if isinstance(buf, torch.Tensor) and x is not buf:
                if tuple(x.shape) != tuple(buf.shape):
                    raise ExecutionError(f"captured plan: input of shape {tuple(x.shape)} given, "
                                         f"captured with {tuple(buf.shape)}")
                buf.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.outputs


def _params(gm: torch.nn.Module) -> list[torch.Tensor]:
    return list(gm.parameters()) + list(gm.buffers())


def _mutable_slots(src: Any, index: Mapping[str, int]) -> tuple[set[int], dict[int, tuple[int, ...]]]:
    """(slots whose value some op changes in place, with every alias an in-place
    op's result creates; slot -> indices of the ops that change it in place)."""
    from opsched.importers.torch_fx import _is_inplace

    owner = {node: op_id for op_id, nodes in src.op_nodes.items() for node in nodes}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    mutated: set[str] = set()
    mutators: dict[int, set[int]] = {}
    for node in src.gm.graph.nodes:
        if node.op.startswith("call_") and node.args and _is_inplace(node, src.gm):
            target = node.args[0]
            if hasattr(target, "name") and target.name in src.slot_of:
                if owner.get(target.name) == owner[node.name]:
                    continue  # changed inside the op that makes it (conv + ReLU(inplace=True)): no one else sees it
                parent[find(node.name)] = find(target.name)
                mutated.add(target.name)
                mutators.setdefault(src.slot_of[target.name], set()).add(index[owner[node.name]])
    roots = {find(m) for m in mutated}
    mutable = {s for name, s in src.slot_of.items() if find(name) in roots}
    return mutable, {s: tuple(sorted(v)) for s, v in mutators.items()}
