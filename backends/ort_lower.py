"""Lowering a Plan to ONNX Runtime sessions: lanes, segments, cross-lane waits.

ONNX Runtime runs a session's nodes one after another; what it cannot do on a
CPU is run parts of a graph side by side with chosen thread counts.  The
``ort`` backend gets that by cutting the graph into sub-models, each one a
pre-built session, run on *lanes* (threads).  :func:`lower` decides the cut
from the Plan's simulated schedule (:func:`opsched.engine.sim.replay` with
the planning model), so the sessions run what the simulator priced:

1. **Lanes.**  A lane is one core slot of the CPU.  The ops are taken in the
   simulated dispatch order; an op with ``k`` threads takes ``k`` lanes that
   are free at its dispatch (the simulator guarantees there are enough): as
   its own lane the free lane that ran its latest-ending input (a chain stays
   on one thread), else the lowest free lane (lane 0 is the calling thread);
   the other ``k - 1`` lanes it holds idle.  Each lane keeps its ops in that
   order.
2. **Dependencies.**  An op waits for its inputs, its ``after`` ops, and the
   ops that held its lanes before it (so no two ops ever share a core, and a
   ``k``-thread op starts only when its ``k`` cores are free, whatever the
   real durations).  A dependency on an op of another lane is *cross-lane*.
3. **Segments.**  A maximal run of consecutive ops on one lane with one
   thread count and one set of held lanes, in which only the first op has
   cross-lane inputs and only the last has cross-lane dependents, is a
   segment: one session with that intra-op thread count.  Cutting at every
   cross-lane dependency (not only where a value crosses) keeps the segment
   graph acyclic: every wait points to a segment that ended earlier in the
   simulated schedule.

A plan in which one segment holds every op is *single*: the whole graph in
one session, exactly ONNX Runtime's sequential execution.  Whether a plan is
worth lowering at all is :func:`choose_plan`'s question.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opsched.engine.contracts import PerfModel
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan, uniform_plan

_EPS = 1e-12


@dataclass(frozen=True)
class Segment:
    """Consecutive ops of one lane run as one session.

    ``ops``: op indices in run order; ``threads``: the session's intra-op
    threads; ``held``: the lanes (core slots) it holds; ``waits``: segments of
    other lanes that must end first; ``inputs`` / ``outputs``: value names it
    reads from outside / writes for other segments and the graph's outputs."""

    index: int
    lane: int
    ops: tuple[int, ...]
    threads: int
    held: tuple[int, ...]
    waits: tuple[int, ...]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lowering:
    """A Plan as segments on lanes (``lanes[l]``: segment indices in run order)."""

    segments: tuple[Segment, ...]
    lanes: tuple[tuple[int, ...], ...]
    sim_makespan: float

    @property
    def single(self) -> bool:
        """One session runs every op: ONNX Runtime's sequential execution."""
        return len(self.segments) == 1

    @property
    def cross_waits(self) -> int:
        return sum(len(s.waits) for s in self.segments)


def lower(graph: OpGraph, plan: Plan, machine: Machine, model: PerfModel) -> Lowering:
    """Segments and lanes for ``plan`` (validated) from its simulated schedule (see the module docstring)."""
    from opsched.engine.sim import prepare, replay

    s = prepare(graph, machine, model)
    st, _ = replay(s, plan)
    n = len(graph.ops)
    cpu = machine.device_index["cpu"]
    cap = machine.cpu.cores
    index = graph.index
    asg = plan.assignments
    deps = [set(graph.pred_index[i]) | {index[d] for d in asg[op.id].after if d != op.id}
            for i, op in enumerate(graph.ops)]
    if any(st.device[i] != cpu for i in range(n)):
        raise PlanError(f"plan for graph {graph.name!r}: the ort backend runs ops only on device 'cpu'")
    order = sorted(range(n), key=lambda i: (st.dispatch_time[i], st.start_time[i], i))
    holder = [-1] * cap
    free_at = [0.0] * cap
    last = [-1] * cap  # last op whose own lane is l
    lane_of = [0] * n
    held: list[tuple[int, ...]] = [()] * n
    lane_ops: list[list[int]] = [[] for _ in range(cap)]
    for i in order:
        t, k = st.dispatch_time[i], st.threads[i]
        free = [lane for lane in range(cap) if free_at[lane] <= t + _EPS]
        if len(free) < k:  # rounding: take the lanes that free up first (their holders are waited for)
            free = sorted(range(cap), key=lambda lane: (free_at[lane], lane))[:k]
        chain = [lane for lane in free if last[lane] in deps[i]]
        own = max(chain, key=lambda lane: (st.end_time[last[lane]], -lane)) if chain else free[0]
        lanes = [own] + [lane for lane in free if lane != own][: k - 1]
        for lane in lanes:
            if holder[lane] >= 0 and holder[lane] != i:
                deps[i].add(holder[lane])
            holder[lane] = i
            free_at[lane] = st.end_time[i]
        last[own] = i
        lane_of[i] = own
        held[i] = tuple(sorted(lanes))
        lane_ops[own].append(i)
    crossing_out = [False] * n
    for i in range(n):
        for j in deps[i]:
            if lane_of[j] != lane_of[i]:
                crossing_out[j] = True
    seg_of = [-1] * n
    raw: list[tuple[int, list[int]]] = []  # (lane, ops)
    for lane, ops in enumerate(lane_ops):
        prev = -1
        for i in ops:
            cut = (prev < 0 or st.threads[i] != st.threads[prev] or held[i] != held[prev] or crossing_out[prev]
                   or any(lane_of[j] != lane for j in deps[i]))
            if cut:
                raw.append((lane, []))
            raw[-1][1].append(i)
            seg_of[i] = len(raw) - 1
            prev = i
    segments = []
    for si, (lane, ops) in enumerate(raw):
        waits = sorted({seg_of[j] for j in deps[ops[0]] if lane_of[j] != lane})
        segments.append(Segment(si, lane, tuple(ops), st.threads[ops[0]], held[ops[0]], tuple(waits)))
    lanes = [tuple(si for si, (lane, _) in enumerate(raw) if lane == ln) for ln in range(cap)]
    _check_acyclic(segments, lanes, graph)
    segments = _with_values(graph, segments)
    return Lowering(tuple(segments), tuple(lanes), float(st.makespan))


def _check_acyclic(segments: Sequence[Segment], lanes: Sequence[Sequence[int]], graph: OpGraph) -> None:
    """Every wait must point to a segment that can finish first (else the run would deadlock)."""
    after: list[list[int]] = [[] for _ in segments]
    indeg = [0] * len(segments)
    for seq in lanes:
        for a, b in zip(seq, seq[1:]):
            after[a].append(b)
            indeg[b] += 1
    for s in segments:
        for w in s.waits:
            after[w].append(s.index)
            indeg[s.index] += 1
    ready = [i for i, d in enumerate(indeg) if not d]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in after[i]:
            indeg[j] -= 1
            if not indeg[j]:
                ready.append(j)
    if seen != len(segments):
        raise ExecutionError(f"graph {graph.name!r}: the plan's segments wait for each other in a cycle "
                             "(a lowering bug; please report it with the plan)")


def _with_values(graph: OpGraph, segments: list[Segment]) -> list[Segment]:
    """Each segment's input and output value names (from the graph's ONNX source, when it has one)."""
    src = graph.source
    if src is None or not hasattr(src, "nodes"):
        return segments
    nodes = [src.nodes[op.id] for op in graph.ops]
    inits = src.initializers
    seg_of = {i: s.index for s in segments for i in s.ops}
    readers: dict[str, set[int]] = {}
    for i, node in enumerate(nodes):
        for x in node.input:
            if x and x not in inits:
                readers.setdefault(x, set()).add(seg_of[i])
    graph_out = set(src.outputs)
    out = []
    for s in segments:
        made = [x for i in s.ops for x in nodes[i].output if x]
        mine = set(made)
        ins = tuple(dict.fromkeys(x for i in s.ops for x in nodes[i].input if x and x not in inits and x not in mine))
        outs = tuple(x for x in made if x in graph_out or readers.get(x, set()) - {s.index})
        out.append(Segment(s.index, s.lane, s.ops, s.threads, s.held, s.waits, ins, outs))
    return out


# ------------------------------------------------------------------ choosing
def single_session_plan(graph: OpGraph, machine: Machine, threads: int | None = None) -> Plan:
    """Every op with every core, in ONNX Runtime's own node order where the graph's
    source records it (else topological): one session, exactly ONNX Runtime's
    sequential execution (the ``ort`` backend then runs ONNX Runtime's own session
    of the model)."""
    from opsched.plan import Assignment

    k = threads or machine.cpu.cores
    order = tuple(getattr(graph.source, "ort_order", ()) or ())
    if not order or set(order) != set(graph.index):
        return uniform_plan(graph, machine, k, policy="ort-single")
    n = len(order)
    asg = {op_id: Assignment("cpu", k, float(n - pos)) for pos, op_id in enumerate(order)}
    return Plan.build(graph, machine, asg, policy="ort-single", order="ort")


def choose_plan(graph: OpGraph, plan: Plan, machine: Machine, model: PerfModel, margin: float = 0.0) -> Plan:
    """``plan`` when the planning model says it beats one whole-graph session by
    more than ``margin`` (a fraction), else the single-session plan (noted in
    its ``meta["instead_of"]``)."""
    from opsched.backends.sim import SimBackend

    single = single_session_plan(graph, machine)
    sim = SimBackend(machine, model=model)
    t_plan = sim.run(graph, plan).makespan
    t_single = sim.run(graph, single).makespan
    if t_plan < t_single * (1.0 - margin):
        return plan
    meta = {"instead_of": plan.policy or "plan", "predicted_s": t_single, "predicted_plan_s": t_plan}
    return Plan(single.assignments, single.graph_fingerprint, single.machine_fingerprint, "ort-single", meta)


def describe(lowering: Lowering) -> dict[str, Any]:
    """A lowering in numbers, for traces and reports."""
    used = [ln for ln in lowering.lanes if ln]
    return {"segments": len(lowering.segments), "lanes": len(used), "cross_waits": lowering.cross_waits,
            "threads": sorted({s.threads for s in lowering.segments})}


__all__ = ["Lowering", "Segment", "choose_plan", "describe", "lower", "single_session_plan"]
