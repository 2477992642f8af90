"""RandWire (Xie et al., 2019, "Exploring Randomly Wired Neural Networks").

The small-regime network: two strided conv stems, then three stages whose
wiring is a random graph - Watts-Strogatz (k=4, p=0.75, the paper's best) for
the first and last stage and Erdos-Renyi (p=0.2) for the middle one (``wiring``
picks ``"ws"``, ``"er"`` or ``"mixed"``).  The undirected graph is oriented
from lower to higher node index; a node aggregates its inputs by a sigmoid-
weighted sum, then ReLU -> separable 3x3 conv -> BN; input nodes read the
stage input with stride 2, and the stage output averages the sink nodes.
The wiring comes from ``seed`` (numpy), so ``build(seed=s)`` is reproducible.
Defaults: 16 nodes per stage, C = 78 channels at ``width=1`` (the paper's
small regime), input 96 x 96; ~310 ops.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from opsched.synthetic import erdos_renyi_edges, watts_strogatz_edges
from opsched.zoo._layers import SepConv, eval_model, scaled

IMAGE_SIZE = 96
NODES = 16
CHANNELS = 78
NUM_CLASSES = 1000


def random_dag(n: int, kind: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    if kind == "ws":
        return watts_strogatz_edges(n, 4, 0.75, rng)
    if kind == "er":
        return erdos_renyi_edges(n, 0.2, rng)
    raise ValueError(f"unknown RandWire wiring {kind!r} (expected 'ws' or 'er')")


class Node(nn.Module):
    """Weighted-sum aggregation -> ReLU -> separable conv -> BN."""

    def __init__(self, n_inputs: int, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.n_inputs = n_inputs
        if n_inputs > 1:
            self.agg_weight = nn.Parameter(0.5 * torch.randn(n_inputs))
        self.op = SepConv(cin, cout, 3, stride)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.n_inputs == 1:
            x = inputs[0]
        else:
            w = torch.sigmoid(self.agg_weight).view(-1, 1, 1, 1, 1)
            x = (torch.stack(inputs, 0) * w).sum(0)
        return self.op(x)


class RandomStage(nn.Module):
    def __init__(self, cin: int, cout: int, edges: list[tuple[int, int]], n: int) -> None:
        super().__init__()
        self.preds = [[a for a, b in edges if b == j] for j in range(n)]
        has_succ = {a for a, _ in edges}
        self.sinks = [j for j in range(n) if j not in has_succ]
        self.nodes = nn.ModuleList(
            Node(max(1, len(p)), cin if not p else cout, cout, 2 if not p else 1) for p in self.preds
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for node, preds in zip(self.nodes, self.preds, strict=True):
            outs.append(node(*[outs[p] for p in preds]) if preds else node(x))
        if len(self.sinks) == 1:
            return outs[self.sinks[0]]
        return torch.stack([outs[j] for j in self.sinks], 0).mean(0)


class RandWire(nn.Module):
    def __init__(self, width: float = 1.0, seed: int = 0, nodes: int = NODES, wiring: str = "mixed",
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        c = scaled(CHANNELS, width)
        kinds = {"mixed": ("ws", "er", "ws"), "ws": ("ws",) * 3, "er": ("er",) * 3}[wiring]
        rng = np.random.default_rng(seed)
        self.stem = nn.Sequential(
            nn.Conv2d(3, c // 2, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c // 2),
            SepConv(c // 2, c, 3, stride=2),
        )
        stages, cin = [], c
        for i, kind in enumerate(kinds):
            cout = c * 2**i
            stages.append(RandomStage(cin, cout, random_dag(nodes, kind, rng), nodes))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(cin, scaled(1280, width), 1, bias=False),
                                  nn.BatchNorm2d(scaled(1280, width)), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(scaled(1280, width), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.head(self.stages(self.stem(x))), 1))


def build(batch: int = 1, width: float = 1.0, seed: int = 0, wiring: str = "mixed") -> tuple[nn.Module, tuple]:
    return eval_model(RandWire(width, seed=seed, wiring=wiring), batch, IMAGE_SIZE)
