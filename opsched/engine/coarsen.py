"""Coarsening: fit a graph larger than the environment's ``max_nodes`` into it.

The device-placement papers (Mirhoseini et al.'s grouper, NN Maestro's layer
groups) schedule groups of ops rather than thousands of single ops.  Here a
graph is coarsened into at most ``max_nodes`` groups (and at most
``max_edges`` group-to-group edges), never by dropping ops:

1. **Chains and small ops.**  Repeatedly contract the edge ``u -> v`` with the
   smallest combined cost among the *safe* ones -- ``u``'s only successor is
   ``v`` or ``v``'s only predecessor is ``u`` -- so no other path ``u -> ... ->
   v`` exists and the contraction cannot create a cycle.  Cheap ops merge
   first; a chain collapses into one group.
2. **Topological neighbours.**  If that is not enough (wide graphs of big
   ops), merge two groups *adjacent in a topological order* of the group graph,
   connected pairs first, cheapest first.  Nothing lies between them in the
   order, so no path can leave the pair and come back: still acyclic.

A group's costs are its members' sums (its time on a device at a thread level
is the sum of its members' times: members run one after another with the
group's assignment).  :meth:`Coarsening.expand` maps a Plan over groups back
to every original op: members inherit the group's device and threads, their
priorities keep the group's dispatch order (member ``j`` of ``m``, in
topological order, gets ``P - j / m`` for the group's ``P``), and a group's
``after`` becomes "the group's entry members wait for the exits of the group
named".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from opsched.engine.contracts import TimeTable
from opsched.errors import GraphError
from opsched.graph import Edge, Op, OpGraph, kahn_order
from opsched.plan import Assignment


@dataclass(frozen=True, eq=False)
class Coarsening:
    """The coarse graph and which original ops each of its groups holds."""

    original: OpGraph
    graph: OpGraph
    groups: tuple[tuple[int, ...], ...]  # original op indices per group, topological order

    @property
    def identity(self) -> bool:
        return self.graph is self.original

    @cached_property
    def group_of(self) -> np.ndarray:
        out = np.empty(len(self.original.ops), dtype=np.int64)
        for g, members in enumerate(self.groups):
            out[list(members)] = g
        return out

    def table(self, table: TimeTable) -> TimeTable:
        """The coarse graph's time table: each group's time is its members' sum."""
        if self.identity:
            return table
        times = np.stack([table.times[list(m)].sum(axis=0) for m in self.groups])
        return TimeTable(times, table.levels, table.device_ids)

    @cached_property
    def _ends(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Per group: its entry members (no predecessor inside) and exits (no successor inside)."""
        g_of = self.group_of
        pred, succ = self.original.pred_index, self.original.succ_index
        entries, exits = [], []
        for g, members in enumerate(self.groups):
            entries.append(tuple(i for i in members if all(g_of[p] != g for p in pred[i])))
            exits.append(tuple(i for i in members if all(g_of[s] != g for s in succ[i])))
        return entries, exits

    def expand(self, assignments: Sequence[Assignment]) -> dict[str, Assignment]:
        """Per-group assignments (``after`` naming group ids) -> per-op assignments."""
        if len(assignments) != len(self.groups):
            raise GraphError(f"coarsening of {self.original.name!r}: {len(assignments)} assignments "
                             f"for {len(self.groups)} groups")
        ops = self.original.ops
        gindex = self.graph.index
        entries, exits = self._ends
        out: dict[str, Assignment] = {}
        for g, (members, a) in enumerate(zip(self.groups, assignments, strict=True)):
            after_ops = tuple(ops[i].id for dep in a.after for i in exits[gindex[dep]])
            m = len(members)
            entry = set(entries[g])
            for j, i in enumerate(members):
                out[ops[i].id] = Assignment(a.device, a.threads, a.priority - j / m,
                                            after_ops if i in entry else ())
        return out


def identity(graph: OpGraph) -> Coarsening:
    return Coarsening(graph, graph, tuple((i,) for i in range(len(graph.ops))))


def n_edge_pairs(graph: OpGraph) -> int:
    """Edges counted once per (src, dst) pair, as the observation lists them."""
    return len(graph.edge_bytes)


def coarsen(graph: OpGraph, max_nodes: int, cost: Sequence[float] | np.ndarray | None = None,
            max_edges: int | None = None) -> Coarsening:
    """Group ``graph`` into at most ``max_nodes`` groups with at most ``max_edges``
    group edges (see the module docstring); the identity when it already fits.

    ``cost``: per-op weight (e.g. its fastest predicted time); defaults to
    FLOPs + bytes moved.
    """
    n = len(graph.ops)
    if max_nodes < 1:
        raise GraphError(f"coarsen: max_nodes must be >= 1, got {max_nodes}")
    max_edges = max_edges if max_edges is not None else 10**18
    if max_edges < 0:
        raise GraphError(f"coarsen: max_edges must be >= 0, got {max_edges}")
    if n <= max_nodes and n_edge_pairs(graph) <= max_edges:
        return identity(graph)
    if cost is None:
        w = np.array([op.flops + op.bytes_total for op in graph.ops], dtype=float)
    else:
        w = np.asarray(cost, dtype=float)
        if w.shape != (n,) or not np.all(np.isfinite(w)):
            raise GraphError(f"coarsen: cost must be {n} finite numbers")
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    weight: dict[int, float] = {i: float(w[i]) for i in range(n)}
    succ: dict[int, set[int]] = {i: set(s) for i, s in enumerate(graph.succ_index)}
    pred: dict[int, set[int]] = {i: set(p) for i, p in enumerate(graph.pred_index)}

    n_edges = [sum(map(len, succ.values()))]

    def fits() -> bool:
        return len(members) <= max_nodes and n_edges[0] <= max_edges

    def merge(u: int, v: int) -> None:
        """Fold group ``v`` into group ``u`` (keeping the edge count)."""
        between = (v in succ[u]) + (u in succ[v])
        before = len(succ[u]) + len(pred[u]) + len(succ[v]) + len(pred[v]) - between
        members[u].extend(members.pop(v))
        weight[u] += weight.pop(v)
        for x in succ.pop(v):
            pred[x].discard(v)
            if x != u:
                pred[x].add(u)
                succ[u].add(x)
        for x in pred.pop(v):
            succ[x].discard(v)
            if x != u:
                succ[x].add(u)
                pred[u].add(x)
        succ[u].discard(v)
        pred[u].discard(v)
        n_edges[0] += len(succ[u]) + len(pred[u]) - before

    # Phase 1: safe edge contractions, cheapest first.
    heap: list[tuple[float, int, int]] = [(weight[u] + weight[v], u, v) for u in succ for v in succ[u]]
    heapq.heapify(heap)
    while heap and not fits():
        _, u, v = heapq.heappop(heap)
        if u not in members or v not in members or v not in succ[u]:
            continue
        if len(succ[u]) != 1 and len(pred[v]) != 1:
            continue  # re-pushed if a neighbour's merge makes it safe (it then touches u or v)
        merge(u, v)
        for x in succ[u]:
            heapq.heappush(heap, (weight[u] + weight[x], u, x))
        for x in pred[u]:
            heapq.heappush(heap, (weight[x] + weight[u], x, u))
            # x's other out-edges may have become safe (x lost a successor)
            for y in succ[x]:
                heapq.heappush(heap, (weight[x] + weight[y], x, y))

    # Phase 2: merge neighbours in a topological order of the groups.
    if not fits():
        order = _group_topo(members, succ, pred)
        nxt = {a: b for a, b in zip(order, order[1:], strict=False)}
        prv = {b: a for a, b in zip(order, order[1:], strict=False)}

        def key(a: int, b: int) -> tuple[int, float, int, int]:
            return (0 if b in succ[a] else 1, weight[a] + weight[b], a, b)

        heap2 = [key(a, b) for a, b in nxt.items()]
        heapq.heapify(heap2)
        while heap2 and not fits():
            _, _, a, b = heapq.heappop(heap2)
            if a not in members or b not in members or nxt.get(a) != b:
                continue
            merge(a, b)
            c = nxt.pop(b, None)
            prv.pop(b, None)
            if c is not None:
                nxt[a], prv[c] = c, a
                heapq.heappush(heap2, key(a, c))
            else:
                nxt.pop(a, None)
            if a in prv:
                heapq.heappush(heap2, key(prv[a], a))
            # weights changed: stale keys of (prv, a) are refreshed by the push above

    return _build(graph, members, w)


def _group_topo(members: dict[int, list[int]], succ: dict[int, set[int]], pred: dict[int, set[int]]) -> list[int]:
    order = kahn_order({g: len(pred[g]) for g in members}, succ)
    if len(order) != len(members):  # cannot happen: every merge above is acyclic
        raise GraphError("coarsen: internal error, the group graph has a cycle")
    return order


def _build(graph: OpGraph, members: dict[int, list[int]], w: np.ndarray) -> Coarsening:
    pos = {i: k for k, i in enumerate(graph.topo_index)}
    groups_raw = [sorted(m, key=pos.__getitem__) for m in members.values()]
    # Number the groups in a topological order of the coarse graph: by their
    # first member's position is not enough (groups interleave), so sort the
    # group DAG itself.
    gid = {}
    for g, m in enumerate(groups_raw):
        for i in m:
            gid[i] = g
    gsucc: dict[int, set[int]] = {g: set() for g in range(len(groups_raw))}
    gpred: dict[int, set[int]] = {g: set() for g in range(len(groups_raw))}
    ebytes: dict[tuple[int, int], float] = {}
    for (s, d), b in graph.edge_bytes.items():
        gs, gd = gid[s], gid[d]
        if gs != gd:
            gsucc[gs].add(gd)
            gpred[gd].add(gs)
            ebytes[(gs, gd)] = ebytes.get((gs, gd), 0.0) + b
    order = _group_topo({g: [] for g in gsucc}, gsucc, gpred)
    new = {g: k for k, g in enumerate(order)}
    groups = tuple(tuple(groups_raw[g]) for g in order)
    ops = []
    weight = w.tolist()
    for k, m in enumerate(groups):
        mem = [graph.ops[i] for i in m]
        lead = graph.ops[max(m, key=weight.__getitem__)]  # the heaviest member (the first of equals)
        name = mem[0].name if len(mem) == 1 else f"{mem[0].name}..{mem[-1].name} ({len(mem)} ops)"
        ops.append(Op(
            id=f"g{k}", name=name, kind=lead.kind,
            flops=float(sum(o.flops for o in mem)),
            bytes_read=float(sum(o.bytes_read for o in mem)),
            bytes_written=float(sum(o.bytes_written for o in mem)),
            param_bytes=float(sum(o.param_bytes for o in mem)),
            shape=lead.shape, dtype=lead.dtype,
        ))
    edges = [Edge(f"g{new[a]}", f"g{new[b]}", b_) for (a, b), b_ in sorted(ebytes.items(),
                                                                            key=lambda kv: (new[kv[0][0]], new[kv[0][1]]))]
    coarse = OpGraph(tuple(ops), tuple(edges), name=f"{graph.name}~{len(groups)}",
                     meta={"coarsened_from": graph.name, "original_ops": len(graph.ops)})
    return Coarsening(graph, coarse, groups)
