"""Synthetic DAG families: deterministic, valid, realistic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.errors import GraphError
from opsched.graph import OP_KINDS
from opsched.synthetic import FAMILIES, KIND_MIX, PLACEMENT_FAMILIES, generate, watts_strogatz_edges


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deterministic_for_a_seed(family):
    a, b = generate(family, 120, seed=7), generate(family, 120, seed=7)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert generate(family, 120, seed=8).fingerprint() != a.fingerprint()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in PLACEMENT_FAMILIES])
def test_realistic_ops_and_edges(family):
    g = generate(family, 300, seed=1)
    assert len(g.ops) == 300 and len(g.edges) > 250
    assert {op.kind for op in g.ops} <= set(KIND_MIX) <= set(OP_KINDS)
    assert len({op.kind for op in g.ops}) >= 5
    by_id = {op.id: op for op in g.ops}
    for e in g.edges:
        assert e.bytes == by_id[e.src].bytes_written > 0
    for op in g.ops:
        if op.kind in ("conv", "matmul"):
            assert op.flops > 0 and op.param_bytes > 0
        assert op.bytes_read >= op.param_bytes
    convs = [op.flops for op in g.ops if op.kind == "conv"]
    assert 1e5 < np.median(convs) < 1e10  # ResNet-like sizes, not toys or monsters
    assert g.width() > 1 and g.width() < 300


@settings(max_examples=30, deadline=None)
@given(family=st.sampled_from(list(FAMILIES)), n=st.integers(1, 60), seed=st.integers(0, 2**31))
def test_any_size_and_seed_gives_a_valid_graph(family, n, seed):
    g = generate(family, n, seed)  # construction validates: acyclic, ids unique, costs finite
    assert len(g.ops) == n
    assert len(g.topological_order()) == n


def test_watts_strogatz_keeps_degree():
    rng = np.random.default_rng(0)
    edges = watts_strogatz_edges(40, 4, 0.75, rng)
    assert len(edges) == 40 * 4 // 2  # rewiring moves edges, never drops them
    assert all(a < b for a, b in edges)


def test_errors_are_clear():
    with pytest.raises(GraphError, match="layered"):
        generate("nope", 10)
    with pytest.raises(GraphError, match="n_ops"):
        generate("layered", 0)
    with pytest.raises(GraphError, match="bad option"):
        generate("layered", 10, 0, bogus=1)
    with pytest.raises(GraphError, match="p must be"):
        generate("erdos_renyi", 10, 0, p=2.0)
