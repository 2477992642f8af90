"""OpGraph: validation errors, derived quantities, JSON round-trip, fingerprint."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.errors import GraphError
from opsched.graph import Edge, Op, OpGraph


def _chain(n: int) -> OpGraph:
    ops = [Op(f"n{i}", f"n{i}", "elementwise", 10.0 * (i + 1)) for i in range(n)]
    return OpGraph(tuple(ops), tuple(Edge(f"n{i}", f"n{i + 1}", 4.0) for i in range(n - 1)))


def test_cycle_names_its_ops():
    ops = [Op(x, x) for x in "abcd"]
    with pytest.raises(GraphError, match=r"cycle: b -> c -> d -> b"):
        OpGraph(tuple(ops), (Edge("a", "b"), Edge("b", "c"), Edge("c", "d"), Edge("d", "b")))


def test_self_loop():
    with pytest.raises(GraphError, match="self-loop on op 'a'"):
        OpGraph((Op("a", "a"),), (Edge("a", "a"),))


def test_edge_to_missing_op():
    with pytest.raises(GraphError, match="missing op 'zz'"):
        OpGraph((Op("a", "a"),), (Edge("a", "zz"),))


def test_duplicate_id():
    with pytest.raises(GraphError, match="duplicate op id 'a'"):
        OpGraph((Op("a", "a"), Op("a", "other")), ())


@pytest.mark.parametrize("field", ["flops", "bytes_read", "bytes_written", "param_bytes"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_bad_costs(field, value):
    with pytest.raises(GraphError, match=f"invalid {field}"):
        OpGraph((Op("a", "a", **{field: value}),), ())


def test_negative_edge_bytes():
    with pytest.raises(GraphError, match="invalid bytes"):
        OpGraph((Op("a", "a"), Op("b", "b")), (Edge("a", "b", -3.0),))


def test_unknown_kind():
    with pytest.raises(GraphError, match="unknown kind 'banana'"):
        OpGraph((Op("a", "a", "banana"),), ())


def test_derived_quantities(diamond):
    assert diamond.topological_order() == ["a", "b", "c", "d"]
    cost = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 1.0}
    assert diamond.upward_rank(cost) == {"a": 5.0, "b": 3.0, "c": 4.0, "d": 1.0}
    length, path = diamond.critical_path(cost)
    assert (length, path) == (5.0, ["a", "c", "d"])
    assert diamond.total_work(cost) == 7.0
    assert diamond.width() == 2
    # communication costs lengthen the rank along the edge they sit on
    ranks = diamond.upward_rank(cost, comm=lambda e: 10.0 if (e.src, e.dst) == ("a", "b") else 0.0)
    assert ranks["a"] == 1.0 + 10.0 + 3.0


def test_width_of_chain_and_antichain():
    assert _chain(12).width() == 1
    flat = OpGraph(tuple(Op(f"x{i}", f"x{i}") for i in range(9)), ())
    assert flat.width() == 9


def test_json_round_trip_is_exact(tmp_path, diamond):
    p = tmp_path / "g.json"
    diamond.save(p)
    back = OpGraph.load(p)
    assert back == diamond
    assert back.fingerprint() == diamond.fingerprint()
    assert back.ops[0].shape == (1, 8, 8, 8)


def test_fingerprint_is_stable_and_sensitive(diamond):
    again = OpGraph(diamond.ops, diamond.edges, name="renamed")
    assert again.fingerprint() == diamond.fingerprint()
    changed = OpGraph((Op("a", "a", "conv", 2e6 + 1),) + diamond.ops[1:], diamond.edges)
    assert changed.fingerprint() != diamond.fingerprint()


def test_load_errors(tmp_path):
    with pytest.raises(GraphError, match="no such graph file"):
        OpGraph.load(tmp_path / "missing.json")
    bad = tmp_path / "trunc.json"
    bad.write_text('{"format": "opsched.graph", "ver')
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.load(bad)
    other = tmp_path / "v9.json"
    other.write_text(json.dumps({"format": "opsched.graph", "version": 9}))
    with pytest.raises(GraphError, match="version 9"):
        OpGraph.load(other)


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 14))
    edges = set()
    for j in range(1, n):
        for i in draw(st.sets(st.integers(0, j - 1), max_size=3)):
            edges.add((i, j))
    ops = tuple(Op(f"v{i}", f"v{i}", "other", float(draw(st.integers(0, 50)))) for i in range(n))
    return OpGraph(ops, tuple(Edge(f"v{i}", f"v{j}", 1.0) for i, j in sorted(edges)))


@settings(max_examples=60, deadline=None)
@given(random_dags())
def test_properties_on_random_dags(g):
    order = g.topological_order()
    pos = {op: k for k, op in enumerate(order)}
    assert sorted(order) == sorted(op.id for op in g.ops)
    assert all(pos[e.src] < pos[e.dst] for e in g.edges)
    cost = {op.id: op.flops for op in g.ops}
    length, path = g.critical_path(cost)
    # the path is a real path and no op's upward rank exceeds its length
    assert all(b in g.successors(a) for a, b in zip(path, path[1:]))
    assert length == pytest.approx(sum(cost[p] for p in path))
    assert max(g.upward_rank(cost).values()) == pytest.approx(length)
    # width: brute-force the largest antichain on small graphs
    reach = {op.id: set() for op in g.ops}
    for i in reversed(order):
        for s in g.successors(i):
            reach[i] |= reach[s] | {s}
    ids = [op.id for op in g.ops]
    best = 0
    if len(ids) <= 12:
        from itertools import combinations

        for r in range(len(ids), 0, -1):
            if any(all(b not in reach[a] and a not in reach[b] for a, b in combinations(c, 2))
                   for c in combinations(ids, r)):
                best = r
                break
        assert g.width() == best
