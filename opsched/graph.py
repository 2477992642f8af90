"""The operation graph every part of opsched shares.

An :class:`OpGraph` is an immutable DAG of :class:`Op` (compute operations, not
framework bookkeeping) joined by :class:`Edge` (a tensor that one op writes and
another reads).  Importers build one from a PyTorch module or a TensorFlow
function; the zoo and the synthetic families build them from code.  Schedulers
read the derived quantities the papers use: topological order, ``upward_rank``
(HEFT / Graphi's critical-path-first priority), ``critical_path``,
``total_work`` and the graph's ``width`` (its largest set of mutually
independent ops, i.e. how much parallelism there is to exploit at best).

Op ids are strings (an fx node name, a TF node name, ``"n17"``); internally the
graph also numbers ops ``0..n-1`` in the order given, and the array-valued
helpers (``pred_index``, ``succ_index``) use those indices, so simulators can
work on plain integer arrays.

Fields are checked strictly where an :class:`Op` or :class:`Edge` is made
(graph JSON files are typed by hand and by other tools): a cost is an int, a
float or a numpy number -- never a bool or a string -- finite and >= 0, and
is stored as a plain Python number (so the JSON and the fingerprint do not
depend on where it came from); a shape is a sequence of whole numbers >= 0.
:class:`~opsched.errors.GraphError` names the op (or edge), the field and,
when loading, the file.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Union

import numpy as np

from opsched.errors import GraphError

#: Canonical op kinds.  Every importer maps its framework's ops onto these.
OP_KINDS: tuple[str, ...] = (
    "conv",
    "matmul",
    "elementwise",
    "pool",
    "norm",
    "concat_split",
    "reduce",
    "embedding",
    "rnn",
    "attention",
    "other",
)
KIND_INDEX = {k: i for i, k in enumerate(OP_KINDS)}

GRAPH_FORMAT = "opsched.graph"
GRAPH_FORMAT_VERSION = 1

#: A per-op cost: a mapping from op id, an array indexed like ``graph.ops``, or a
#: function of the op.
Cost = Union[Mapping[str, float], Sequence[float], np.ndarray, Callable[["Op"], float]]


@dataclass(frozen=True)
class Op:
    """One operation: what it computes and how much data it moves.

    ``flops`` counts floating-point operations (a multiply-add is two), the byte
    counts are the op's own tensor traffic, ``param_bytes`` the weights it reads
    (already included in ``bytes_read``).
    """

    id: str
    name: str
    kind: str = "other"
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    param_bytes: float = 0.0
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if type(self.id) is not str or not self.id:
            raise GraphError(f"an op's id must be a non-empty string, got {_shown(self.id)}")
        for fname in ("name", "kind", "dtype"):
            if not isinstance(getattr(self, fname), str):
                raise GraphError(f"op {self.id!r}: {fname} must be a string, got {_shown(getattr(self, fname))}")
        for fname in _COST_FIELDS:
            v = getattr(self, fname)
            if type(v) is not float and type(v) is not int:
                object.__setattr__(self, fname, _number(f"op {self.id!r}", fname, v))
            elif not (0 <= v < math.inf):  # also False for NaN
                raise GraphError(f"op {self.id!r} has an invalid {fname} = {v!r} (must be a finite number >= 0)")
        shape = self.shape
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            object.__setattr__(self, "shape", _shape(f"op {self.id!r}", shape))

    @property
    def bytes_total(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved: high for conv/matmul (compute-bound), low for elementwise."""
        return self.flops / max(self.bytes_total, 1.0)

#: Op's field names in declaration order (what to_dict writes; a shallow copy: all are scalars but ``shape``).
_OP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Op))
_COST_FIELDS = ("flops", "bytes_read", "bytes_written", "param_bytes")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _number(where: str, fname: str, v: Any) -> float | int:
    """A cost as a plain Python number: ints and floats as they are, numpy numbers
    converted; bools, strings and everything else refused; finite and >= 0."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise GraphError(f"{where} has an invalid {fname} = {_shown(v)} (must be a finite number >= 0: "
                         "an int, a float or a numpy number, not a bool or a string)")
    v = v.item() if isinstance(v, np.generic) else (float(v) if isinstance(v, float) else int(v))
    if not (0 <= v < math.inf):
        raise GraphError(f"{where} has an invalid {fname} = {v!r} (must be a finite number >= 0)")
    return v


def _shape(where: str, shape: Any) -> tuple[int, ...]:
    """A shape as a tuple of ints >= 0 (a list or tuple of ints or numpy ints; not a string)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)):
        raise GraphError(f"{where}: shape must be a list of whole numbers >= 0, got {_shown(shape)}")
    out = []
    for d in shape:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0:
            raise GraphError(f"{where}: shape must be a list of whole numbers >= 0, got {list(shape)!r} "
                             f"(the dimension {_shown(d)})")
        out.append(int(d))
    return tuple(out)


@dataclass(frozen=True)
class Edge:
    """A data dependency: ``dst`` reads a tensor of ``bytes`` written by ``src``."""

    src: str
    dst: str
    bytes: float = 0.0

    def __post_init__(self) -> None:
        if type(self.src) is not str or type(self.dst) is not str:
            raise GraphError(f"edge {self.src!r} -> {self.dst!r}: both ends must be op ids (strings), got "
                             f"{_shown(self.src)} -> {_shown(self.dst)}")
        v = self.bytes
        if type(v) is not float and type(v) is not int:
            object.__setattr__(self, "bytes", _number(f"edge {self.src!r} -> {self.dst!r}", "bytes", v))
        elif not (0 <= v < math.inf):
            raise GraphError(f"edge {self.src!r} -> {self.dst!r} has invalid bytes = {v!r} "
                             "(must be a finite number >= 0)")


def kahn_order(indegree: Mapping[int, int], succ: Mapping[int, Iterable[int]] | Sequence[Iterable[int]]) -> list[int]:
    """Kahn's algorithm over nodes numbered by int, the lowest-numbered ready node
    first.  Returns fewer nodes than ``indegree`` holds when there is a cycle (the
    caller says what that means for it)."""
    indeg = dict(indegree)
    ready = [i for i, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    return order


@dataclass(frozen=True, eq=False)
class OpGraph:
    """An immutable, validated DAG of operations.

    Construction validates (see :meth:`validate`), so an ``OpGraph`` that exists
    is acyclic and consistent.  ``source`` carries what a real backend needs to
    execute the graph (for PyTorch, the traced ``torch.fx.GraphModule``); it is
    not part of equality, JSON or the fingerprint.
    """

    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    name: str = "graph"
    meta: Mapping[str, Any] = field(default_factory=dict)
    source: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "meta", dict(self.meta))
        self.validate()

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return len(self.ops)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return (self.name, self.ops, self.edges, dict(self.meta)) == (
            other.name,
            other.ops,
            other.edges,
            dict(other.meta),
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    @cached_property
    def index(self) -> dict[str, int]:
        """Op id -> position in ``ops``."""
        return {op.id: i for i, op in enumerate(self.ops)}

    def op(self, op_id: str) -> Op:
        try:
            return self.ops[self.index[op_id]]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no op {op_id!r}") from None

    @cached_property
    def pred_index(self) -> tuple[tuple[int, ...], ...]:
        """For op i, the indices of the ops it reads from (deduplicated)."""
        preds: list[set[int]] = [set() for _ in self.ops]
        for e in self.edges:
            preds[self.index[e.dst]].add(self.index[e.src])
        return tuple(tuple(sorted(p)) for p in preds)

    @cached_property
    def succ_index(self) -> tuple[tuple[int, ...], ...]:
        succs: list[set[int]] = [set() for _ in self.ops]
        for e in self.edges:
            succs[self.index[e.src]].add(self.index[e.dst])
        return tuple(tuple(sorted(s)) for s in succs)

    @cached_property
    def edge_bytes(self) -> dict[tuple[int, int], float]:
        """(src index, dst index) -> bytes; parallel edges are summed."""
        out: dict[tuple[int, int], float] = {}
        for e in self.edges:
            key = (self.index[e.src], self.index[e.dst])
            out[key] = out.get(key, 0.0) + e.bytes
        return out

    def predecessors(self, op_id: str) -> list[str]:
        return [self.ops[j].id for j in self.pred_index[self.index[op_id]]]

    def successors(self, op_id: str) -> list[str]:
        return [self.ops[j].id for j in self.succ_index[self.index[op_id]]]

    @property
    def sources(self) -> list[str]:
        return [op.id for op, p in zip(self.ops, self.pred_index) if not p]

    @property
    def sinks(self) -> list[str]:
        return [op.id for op, s in zip(self.ops, self.succ_index) if not s]

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise :class:`GraphError` naming the problem: a duplicate id, an edge
        to a missing op, a self-loop or cycle (with the ops on it), or a
        negative / NaN / infinite cost field."""
        seen: set[str] = set()
        for op in self.ops:
            if op.id in seen:
                raise GraphError(f"graph {self.name!r}: duplicate op id {op.id!r}")
            seen.add(op.id)
            if op.kind not in KIND_INDEX:
                raise GraphError(
                    f"graph {self.name!r}: op {op.id!r} has unknown kind {op.kind!r}; "
                    f"expected one of {', '.join(OP_KINDS)}"
                )
            for fname in ("flops", "bytes_read", "bytes_written", "param_bytes"):
                v = getattr(op, fname)
                if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v < 0:
                    raise GraphError(
                        f"graph {self.name!r}: op {op.id!r} has an invalid {fname} = {v!r} "
                        "(must be a finite number >= 0)"
                    )
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in seen:
                    raise GraphError(
                        f"graph {self.name!r}: edge {e.src!r} -> {e.dst!r} refers to missing op {end!r}"
                    )
            if e.src == e.dst:
                raise GraphError(f"graph {self.name!r}: self-loop on op {e.src!r}")
            if not isinstance(e.bytes, (int, float)) or math.isnan(e.bytes) or math.isinf(e.bytes) or e.bytes < 0:
                raise GraphError(
                    f"graph {self.name!r}: edge {e.src!r} -> {e.dst!r} has invalid bytes = {e.bytes!r}"
                )
        cycle = self._find_cycle()
        if cycle:
            raise GraphError(
                f"graph {self.name!r} has a cycle: {' -> '.join(cycle + [cycle[0]])}"
            )

    def _find_cycle(self) -> list[str]:
        """Return the op ids on one cycle, or [] when the graph is acyclic."""
        succ: dict[str, list[str]] = {op.id: [] for op in self.ops}
        for e in self.edges:
            succ[e.src].append(e.dst)
        white, grey, black = 0, 1, 2
        colour = dict.fromkeys(succ, white)
        parent: dict[str, str] = {}
        for root in succ:
            if colour[root] != white:
                continue
            stack = [(root, iter(succ[root]))]
            colour[root] = grey
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    colour[node] = black
                    stack.pop()
                elif colour[nxt] == white:
                    colour[nxt] = grey
                    parent[nxt] = node
                    stack.append((nxt, iter(succ[nxt])))
                elif colour[nxt] == grey:
                    cycle = [node]
                    while cycle[-1] != nxt:
                        cycle.append(parent[cycle[-1]])
                    return cycle[::-1]
        return []

    # ---------------------------------------------------------- derived values
    @cached_property
    def topo_index(self) -> tuple[int, ...]:
        """A topological order as op indices: Kahn's algorithm taking the
        lowest-index ready op first, so it follows the graph's own order (an fx
        trace's order) wherever the dependencies allow; that order keeps
        producer and consumer close, which is good for caches."""
        return tuple(kahn_order({i: len(p) for i, p in enumerate(self.pred_index)}, self.succ_index))

    def topological_order(self) -> list[str]:
        return [self.ops[i].id for i in self.topo_index]

    def cost_array(self, cost: Cost) -> np.ndarray:
        """Turn any accepted per-op cost into a float array indexed like ``ops``."""
        if callable(cost):
            arr = np.array([float(cost(op)) for op in self.ops], dtype=float)
        elif isinstance(cost, Mapping):
            try:
                arr = np.array([float(cost[op.id]) for op in self.ops], dtype=float)
            except KeyError as exc:
                raise GraphError(f"cost has no entry for op {exc.args[0]!r}") from None
        else:
            arr = np.asarray(cost, dtype=float)
            if arr.shape != (len(self.ops),):
                raise GraphError(f"cost array has shape {arr.shape}, expected ({len(self.ops)},)")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise GraphError("costs must be finite and >= 0")
        return arr

    def upward_rank(self, cost: Cost, comm: Callable[[Edge], float] | None = None) -> dict[str, float]:
        """HEFT's upward rank: an op's cost plus the longest (cost + communication)
        path from it to an exit op.  Graphi's critical-path-first dispatches by it."""
        ranks = self.upward_rank_array(cost, comm)
        return {op.id: float(r) for op, r in zip(self.ops, ranks)}

    def upward_rank_array(self, cost: Cost, comm: Callable[[Edge], float] | None = None) -> np.ndarray:
        w = self.cost_array(cost)
        c: dict[tuple[int, int], float] = {}
        if comm is not None:
            for e in self.edges:
                key = (self.index[e.src], self.index[e.dst])
                c[key] = max(c.get(key, 0.0), float(comm(e)))
        rank = np.zeros(len(self.ops))
        for i in reversed(self.topo_index):
            best = 0.0
            for j in self.succ_index[i]:
                best = max(best, c.get((i, j), 0.0) + rank[j])
            rank[i] = w[i] + best
        return rank

    def critical_path(self, cost: Cost) -> tuple[float, list[str]]:
        """The longest cost path through the graph: (its length, its op ids in order)."""
        w = self.cost_array(cost)
        if not self.ops:
            return 0.0, []
        rank = self.upward_rank_array(w)
        i = max((self.index[s] for s in self.sources), key=lambda k: rank[k])
        path = [i]
        while self.succ_index[i]:
            i = max(self.succ_index[i], key=lambda j: rank[j])
            path.append(i)
        return float(rank[path[0]]), [self.ops[k].id for k in path]

    def total_work(self, cost: Cost) -> float:
        return float(self.cost_array(cost).sum())

    @cached_property
    def levels(self) -> tuple[int, ...]:
        """Longest-path depth of each op from a source (sources are level 0)."""
        lv = [0] * len(self.ops)
        for i in self.topo_index:
            for j in self.succ_index[i]:
                lv[j] = max(lv[j], lv[i] + 1)
        return tuple(lv)

    def width(self, exact_limit: int = 1500) -> int:
        """The size of the largest antichain (ops no path connects).

        Exact by Dilworth's theorem (n minus a maximum matching in the
        reachability bipartite graph) up to ``exact_limit`` ops; above that the
        widest topological level, a lower bound that is usually close.
        """
        n = len(self.ops)
        if n == 0:
            return 0
        if n > exact_limit:
            return max(np.bincount(np.array(self.levels)))
        return _max_antichain(n, self.topo_index, self.succ_index)

    # --------------------------------------------------------------- identity
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GRAPH_FORMAT,
            "version": GRAPH_FORMAT_VERSION,
            "name": self.name,
            "meta": dict(self.meta),
            "ops": [{**{f: getattr(op, f) for f in _OP_FIELDS}, "shape": list(op.shape)} for op in self.ops],
            "edges": [[e.src, e.dst, e.bytes] for e in self.edges],
        }

    def fingerprint(self) -> str:
        """A stable hash of the structure and costs (not the name or meta)."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        # Computed once: the graph is immutable and every Plan.validate asks for it.
        d = self.to_dict()
        blob = json.dumps({"ops": d["ops"], "edges": d["edges"]}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> OpGraph:
        if not isinstance(data, Mapping) or data.get("format") != GRAPH_FORMAT:
            raise GraphError(f"{where}: not an opsched graph (missing format {GRAPH_FORMAT!r})")
        if data.get("version") != GRAPH_FORMAT_VERSION:
            raise GraphError(
                f"{where}: graph format version {data.get('version')!r} is not supported "
                f"(this opsched reads version {GRAPH_FORMAT_VERSION})"
            )
        raw_ops, raw_edges = data.get("ops"), data.get("edges")
        if not isinstance(raw_ops, list):
            raise GraphError(f"{where}: 'ops' must be a list of ops, got {_shown(raw_ops)}")
        if not isinstance(raw_edges, list):
            raise GraphError(f"{where}: 'edges' must be a list of [src, dst, bytes], got {_shown(raw_edges)}")
        name, meta = data.get("name", "graph"), data.get("meta", {})
        if not isinstance(name, str):
            raise GraphError(f"{where}: name must be a string, got {_shown(name)}")
        if not isinstance(meta, Mapping):
            raise GraphError(f"{where}: meta must be a mapping, got {_shown(meta)}")
        ops = []
        for k, o in enumerate(raw_ops):
            label = f"ops[{k}]" + (f" ({o['id']!r})" if isinstance(o, Mapping) and isinstance(o.get("id"), str)
                                   else "")
            if not isinstance(o, Mapping):
                raise GraphError(f"{where}: {label} must be a mapping of fields, got {_shown(o)}")
            unknown = [key for key in o if key not in _OP_FIELDS]
            if unknown:
                raise GraphError(f"{where}: {label}: unknown field {unknown[0]!r}; an op has {', '.join(_OP_FIELDS)}")
            missing = [key for key in ("id", "name") if key not in o]
            if missing:
                raise GraphError(f"{where}: {label}: missing field {missing[0]!r}")
            if type(o["id"]) is not str or not o["id"]:
                raise GraphError(f"{where}: {label}: id must be a non-empty string, got {_shown(o['id'])}")
            try:
                ops.append(Op(**o))
            except GraphError as exc:
                raise GraphError(f"{where}: {exc}") from None
        edges = []
        for k, e in enumerate(raw_edges):
            if not isinstance(e, (list, tuple)) or len(e) != 3:
                raise GraphError(f"{where}: edges[{k}] must be [src, dst, bytes], got {e!r}")
            try:
                edges.append(Edge(*e))
            except GraphError as exc:
                raise GraphError(f"{where}: edges[{k}]: {exc}") from None
        try:
            return cls(tuple(ops), tuple(edges), name=name, meta=meta)
        except GraphError as exc:
            raise GraphError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        from opsched.io import read_json

        return cls.from_dict(read_json(path, GraphError, "graph"), where=str(path))

    def with_source(self, source: Any) -> OpGraph:
        """A copy that carries an executable ``source`` (validation is not repeated)."""
        g = object.__new__(OpGraph)
        for f in ("ops", "edges", "name", "meta"):
            object.__setattr__(g, f, getattr(self, f))
        object.__setattr__(g, "source", source)
        return g

    def source_with(self, attrs: Sequence[str], error: type[Exception], what: str, importer: str) -> Any:
        """The executable ``source`` when it has every attribute in ``attrs``, else
        ``error`` saying the graph has no ``what`` and which ``importer`` gives one
        (a graph loaded from JSON carries no tensors)."""
        src = self.source
        if src is None or not all(hasattr(src, a) for a in attrs):
            raise error(f"graph {self.name!r} has no {what} (source is {type(src).__name__}); import it with "
                        f"{importer} - a graph loaded from JSON carries no tensors")
        return src

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ops": len(self.ops),
            "edges": len(self.edges),
            "gflops": self.total_flops / 1e9,
            "width": self.width(),
            "depth": (max(self.levels) + 1) if self.ops else 0,
        }


def _max_antichain(n: int, topo: Sequence[int], succ: Sequence[Iterable[int]]) -> int:
    """Dilworth: max antichain = n - max matching in the comparability bipartite graph."""
    # Reachability as Python int bitsets, computed in reverse topological order.
    reach = [0] * n
    for i in reversed(topo):
        r = 0
        for j in succ[i]:
            r |= reach[j] | (1 << j)
        reach[i] = r
    adj = [[j for j in range(n) if (reach[i] >> j) & 1] for i in range(n)]
    match_right = [-1] * n

    def augment(u: int, seen: list[bool]) -> bool:
        # Iterative DFS for an augmenting path from left vertex u.
        stack = [(u, iter(adj[u]))]
        path: list[tuple[int, int]] = []
        while stack:
            x, it = stack[-1]
            advanced = False
            for v in it:
                if seen[v]:
                    continue
                seen[v] = True
                if match_right[v] == -1:
                    path.append((x, v))
                    for a, b in path:
                        match_right[b] = a
                    return True
                path.append((x, v))
                stack.append((match_right[v], iter(adj[match_right[v]])))
                advanced = True
                break
            if not advanced:
                stack.pop()
                if path:
                    path.pop()
        return False

    matching = 0
    for u in range(n):
        if adj[u] and augment(u, [False] * n):
            matching += 1
    return n - matching
