"""A multi-layer LSTM unrolled over time from matmuls and elementwise ops.

``nn.LSTM`` is one opaque kernel to torch.fx; here every step of every layer
is explicit (two GEMMs, the gate nonlinearities, the cell update), so the
graph shows the real dependency structure: a ``layers x steps`` grid in which
layer l at step t can co-run with layer l-1 at step t+1 (the wavefront the
Liu et al. runtime exploits).  Defaults: 2 layers, 16 steps, input 256,
hidden 512 at ``width=1``; ~410 ops.  Output: the top layer's last hidden
state through a linear classifier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsched.zoo._layers import scaled

LAYERS = 2
STEPS = 16
INPUT = 256
HIDDEN = 512
NUM_CLASSES = 10


class LSTMLayer(nn.Module):
    def __init__(self, cin: int, hidden: int) -> None:
        super().__init__()
        k = hidden**-0.5
        self.w_ih = nn.Parameter(torch.empty(4 * hidden, cin).uniform_(-k, k))
        self.w_hh = nn.Parameter(torch.empty(4 * hidden, hidden).uniform_(-k, k))
        self.bias = nn.Parameter(torch.empty(4 * hidden).uniform_(-k, k))

    def step(self, x: torch.Tensor, h: torch.Tensor | None, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        gates = F.linear(x, self.w_ih, self.bias)
        if h is not None:
            gates = gates + F.linear(h, self.w_hh)
        i, f, g, o = gates.chunk(4, 1)
        i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
        c = i * g if c is None else f * c + i * g
        return o * torch.tanh(c), c


class UnrolledLSTM(nn.Module):
    def __init__(self, width: float = 1.0, layers: int = LAYERS, steps: int = STEPS,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        hidden = scaled(HIDDEN, width)
        self.steps = steps
        self.layers = nn.ModuleList(LSTMLayer(INPUT if i == 0 else hidden, hidden) for i in range(layers))
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = [x[:, t] for t in range(self.steps)]
        for layer in self.layers:
            assert isinstance(layer, LSTMLayer)  # self.layers holds LSTMLayers only (__init__)
            h = c = None
            outs = []
            for xt in seq:
                h, c = layer.step(xt, h, c)
                outs.append(h)
            seq = outs
        return self.fc(seq[-1])


def build(batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    model = UnrolledLSTM(width)
    return model.eval(), (torch.randn(batch, STEPS, INPUT),)
