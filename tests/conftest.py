"""Shared fixtures and the gpu / tf markers' skip logic."""

from __future__ import annotations

import importlib.util

import pytest

from opsched.graph import Edge, Op, OpGraph


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_tf = pytest.mark.skip(reason="needs tensorflow (pip install -e '.[tf]')")
    has_cuda = _has_cuda()
    has_tf = importlib.util.find_spec("tensorflow") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "tf" in item.keywords and not has_tf:
            item.add_marker(skip_tf)


@pytest.fixture
def diamond() -> OpGraph:
    """a -> (b, c) -> d: the smallest graph with two parallel branches."""
    ops = [
        Op("a", "a", "conv", 2e6, 1e4, 1e4, 1e3, (1, 8, 8, 8)),
        Op("b", "b", "matmul", 4e6, 2e4, 1e4, 2e3, (1, 64)),
        Op("c", "c", "elementwise", 1e4, 1e4, 1e4, 0, (1, 64)),
        Op("d", "d", "concat_split", 0, 2e4, 2e4, 0, (1, 128)),
    ]
    edges = [Edge("a", "b", 1e4), Edge("a", "c", 1e4), Edge("b", "d", 1e4), Edge("c", "d", 1e4)]
    return OpGraph(tuple(ops), tuple(edges), name="diamond")
