"""Test helpers for the bounds and the moldable-task heuristics: a perfectly
scaling performance model and a chain of ops."""

from __future__ import annotations

from opsched.engine.models.analytic import AnalyticModel
from opsched.graph import Edge, Op, OpGraph


class PerfectScaling(AnalyticModel):
    """t(k) = flops / (per-core peak x k) on a CPU, flops / peak on a GPU: no
    serial part, no sync cost, no memory term (the textbook moldable task)."""

    name = "perfect-scaling"

    def op_time(self, op, device, threads):
        if device.is_gpu:
            return op.flops / (device.gflops * 1e9)
        return op.flops / (device.gflops * 1e9) / threads


def chain(n: int = 5, flops: float = 4e8) -> OpGraph:
    """``n`` matmul-sized ops one after another, tiny tensors between them."""
    ops = tuple(Op(f"c{i}", f"c{i}", "matmul", flops * (1 + i % 3), 1e3, 1e3, 0.0, (1, 16)) for i in range(n))
    edges = tuple(Edge(f"c{i}", f"c{i + 1}", 1e3) for i in range(n - 1))
    return OpGraph(ops, edges, name=f"chain-{n}")


def fork(width: int = 6, flops: float = 2e8) -> OpGraph:
    """One source, ``width`` independent ops, one sink."""
    ops = [Op("src", "src", "elementwise", 0.0, 1e3, 1e3, 0.0, (1, 16))]
    ops += [Op(f"b{i}", f"b{i}", "matmul", flops * (1 + i), 1e3, 1e3, 0.0, (1, 16)) for i in range(width)]
    ops.append(Op("sink", "sink", "concat_split", 0.0, 1e3 * width, 1e3, 0.0, (1, 16)))
    edges = [Edge("src", f"b{i}", 1e3) for i in range(width)] + [Edge(f"b{i}", "sink", 1e3) for i in range(width)]
    return OpGraph(tuple(ops), tuple(edges), name=f"fork-{width}")
