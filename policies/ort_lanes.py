"""Lane plans for the ``ort`` backend: few, long segments that co-run.

A plan runs on the ``ort`` backend as segments on lanes (``backends/ort_lower.py``),
and every segment boundary costs a session launch and often a hand-off
between threads, so a good plan for it keeps chains of ops on one lane and
co-runs *branches*, not single ops.  Generic policies (critical-path-first
and the learned policy's candidates) pick the highest-priority ready op
wherever a core frees, which on a graph of many small nodes (an unrolled LSTM
at batch 1) cuts it into hundreds of segments.

:func:`lane_plan` is HEFT (Topcuoglu et al.; the one implementation,
:func:`opsched.policies.heft.heft_schedule`, without insertion) with the CPU's core slots as the
processors and a cross-lane hand-off as the communication cost: ops in
decreasing upward rank, each on the lane where it finishes first, counting a
hand-off for every input made on another lane - which keeps chains together
unless co-running pays for the hand-off.  *Wide* ops (those whose time at all
cores beats one core by a margin) take every lane.  The result is a Plan: per
op its threads, a priority that follows the schedule, and ``after`` on the
previous op of its lane (of every lane for a wide op), so the simulator and
the lowering reproduce the lanes.  :class:`LanePlanner` tries a few hand-off
costs and wide-op thresholds and keeps the plan the planning model predicts
fastest.

:func:`cluster_plan` gets fewer segments still on graphs of many small nodes:
linear clustering (Kim and Browne: the heaviest remaining path, again and
again) makes chains, and each chain, heaviest first, moves to the lane that
shortens the lane schedule most - an unrolled LSTM's layers land on separate
lanes (a wavefront) instead of being interleaved node by node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import Policy, build_plan, resolve_model
from opsched.policies.heft import heft_schedule
from opsched.policies.registry import register

#: Hand-off cost the lanes are planned with when the model has no runtime model (seconds).
DEFAULT_HANDOFF_S = 30e-6


def _schedule(graph: OpGraph, lanes: int, cost: np.ndarray, wide: np.ndarray, handoff_s: float, cut_s: float,
              assign: Sequence[int] | None = None) -> tuple[list[int], list[float], list[float], list[tuple[int, ...]]]:
    """HEFT (:func:`opsched.policies.heft.heft_schedule`, without insertion) on ``lanes`` identical
    processors, the ops in decreasing upward rank: each on its ``assign`` lane, or (``assign`` None)
    on the lane where it finishes first.  An input from another lane arrives ``handoff_s`` late;
    starting a new segment (an input from another lane, or after an op another lane reads) costs
    ``cut_s``.  A wide op waits for every lane.  Returns each op's lane, start, finish and the ops
    it follows on its lanes."""
    n = len(graph.ops)
    rank = graph.upward_rank_array(cost)
    order = sorted(range(n), key=lambda i: (-rank[i], i))
    comp = np.repeat(np.asarray(cost, dtype=float)[:, None], lanes, axis=1)
    edges = [(a, b) for b in range(n) for a in graph.pred_index[b]]
    s = heft_schedule(comp, {}, edges, insertion=False, order=order, wide=wide, segment_cost=cut_s, assign=assign,
                      tolerance=1e-12, transfer=lambda j, i, a, b: handoff_s)
    return [int(q) for q in s.proc], s.start.tolist(), s.finish.tolist(), list(s.prev)


def _plan(graph: OpGraph, machine: Machine, wide: np.ndarray, start: Sequence[float], finish: Sequence[float],
          after: Sequence[tuple[int, ...]], name: str, **meta: Any) -> Plan:
    """The Plan of a lane schedule: threads, priorities in start order, ``after`` the lane's previous op."""
    n = len(graph.ops)
    by_start = sorted(range(n), key=lambda i: (start[i], finish[i], i))
    prio = {i: float(n - k) for k, i in enumerate(by_start)}
    cores = machine.cpu.cores
    ids = [op.id for op in graph.ops]
    preds = graph.pred_index
    asg = {ids[i]: Assignment("cpu", cores if wide[i] else 1, prio[i],
                              tuple(ids[j] for j in after[i] if j not in preds[i]))
           for i in range(n)}
    return build_plan(graph, machine, asg, policy=name, lanes=cores, wide=int(np.sum(wide)),
                      predicted_s=float(max(finish, default=0.0)), **meta)


def lane_plan(graph: OpGraph, machine: Machine, t1: np.ndarray, tk: np.ndarray, handoff_s: float,
              wide: np.ndarray, cut_s: float = 0.0, name: str = "ort-lanes", **meta: Any) -> Plan:
    """HEFT on ``machine.cpu.cores`` lanes (see the module docstring).

    ``t1`` / ``tk``: each op's seconds on one thread / on every core;
    ``wide[i]``: op ``i`` takes every lane; ``cut_s``: what starting a new
    segment costs (an op with an input from another lane, or after an op
    another lane reads), charged whether or not the lane waits."""
    cost = np.where(wide, tk, t1)
    _, start, finish, after = _schedule(graph, machine.cpu.cores, cost, wide, handoff_s, cut_s)
    return _plan(graph, machine, wide, start, finish, after, name, handoff_s=handoff_s, **meta)


def linear_clusters(graph: OpGraph, cost: np.ndarray, skip: np.ndarray | None = None) -> list[list[int]]:
    """Linear clustering (Kim and Browne): the heaviest path of the ops left, again
    and again, until every op (but ``skip``) is in a path; heaviest first."""
    n = len(graph.ops)
    left = np.ones(n, bool) if skip is None else ~skip
    succ = graph.succ_index
    topo = graph.topo_index
    out = []
    while left.any():
        best = np.zeros(n)
        nxt = [-1] * n
        for i in reversed(topo):
            if not left[i]:
                continue
            b, j = 0.0, -1
            for s in succ[i]:
                if left[s] and best[s] > b:
                    b, j = best[s], s
            best[i] = cost[i] + b
            nxt[i] = j
        i = int(np.argmax(np.where(left, best, -1.0)))
        path = []
        while i >= 0:
            path.append(i)
            left[i] = False
            i = nxt[i]
        out.append(path)
    return out


def cluster_plan(graph: OpGraph, machine: Machine, t1: np.ndarray, tk: np.ndarray, handoff_s: float,
                 wide: np.ndarray, cut_s: float = 0.0, passes: int = 2, name: str = "ort-lanes",
                 **meta: Any) -> Plan:
    """Linear clusters (chains) assigned to lanes: each cluster, heaviest first, moves
    to the lane that shortens the list schedule most (:func:`_schedule` with the
    assignment fixed), ``passes`` times; few cross-lane edges, so few segments."""
    lanes = machine.cpu.cores
    cost = np.where(wide, tk, t1)
    clusters = linear_clusters(graph, cost, wide)
    assign = [0] * len(graph.ops)
    best = _schedule(graph, lanes, cost, wide, handoff_s, cut_s, assign)
    span = max(best[2], default=0.0)
    for _ in range(passes):
        moved = False
        for c in clusters:
            here = assign[c[0]]
            for lane in range(lanes):
                if lane == here:
                    continue
                for i in c:
                    assign[i] = lane
                trial = _schedule(graph, lanes, cost, wide, handoff_s, cut_s, assign)
                t = max(trial[2], default=0.0)
                if t < span - 1e-12:
                    best, span, here, moved = trial, t, lane, True
                for i in c:
                    assign[i] = here
        if not moved:
            break
    _, start, finish, after = best
    return _plan(graph, machine, wide, start, finish, after, name, handoff_s=handoff_s, clusters=len(clusters),
                 **meta)


@register("ort-lanes", roles=(), order=60)
class LanePlanner(Policy):
    """HEFT on lanes for the ``ort`` backend, the best of a few settings under the model."""

    name = "ort-lanes"

    def candidates(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> dict[str, Plan]:
        model = resolve_model(model)
        table = model.time_table(graph, machine)
        d = machine.device_index["cpu"]
        cores = machine.cpu.cores
        t1 = np.asarray(table.on(d, 1), dtype=float)
        tk = np.asarray(table.on(d, cores), dtype=float) if cores in table.level_index[d] else t1
        runtime = getattr(model, "runtime", None)
        h = float(getattr(runtime, "handoff_s", 0.0) or DEFAULT_HANDOFF_S)
        out: dict[str, Plan] = {}
        masks: list[np.ndarray] = []
        for speedup in (None, 1.5, 1.2):
            wide = np.zeros(len(graph.ops), bool) if speedup is None or cores == 1 else (t1 >= speedup * tk)
            if any(np.array_equal(wide, m) for m in masks):
                continue  # no op crosses this threshold that did not cross the last: the same plans
            masks.append(wide)
            tag = "" if speedup is None else f"-wide{speedup:g}"
            for scale in (1.0, 3.0):
                key = f"heft-h{scale:g}{tag}"
                out[key] = lane_plan(graph, machine, t1, tk, h * scale, wide, cut_s=h * scale / 3, name=self.name,
                                     setting=key)
                key = f"chains-h{scale:g}{tag}"
                out[key] = cluster_plan(graph, machine, t1, tk, h * scale, wide, cut_s=h * scale / 3,
                                        name=self.name, setting=key)
        return out

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        from opsched.engine.sim import Simulator

        model = resolve_model(model)
        sim = Simulator(machine, model=model)
        scored = {k: (sim.run(graph, p).makespan, p) for k, p in self.candidates(graph, machine, model).items()}
        key = min(scored, key=lambda k: scored[k][0])
        best = scored[key][1]
        meta = {**dict(best.meta), "chosen": key, "candidates": {k: v[0] for k, v in scored.items()}}
        return Plan(best.assignments, best.graph_fingerprint, best.machine_fingerprint, self.name, meta)


__all__ = ["DEFAULT_HANDOFF_S", "LanePlanner", "lane_plan"]
