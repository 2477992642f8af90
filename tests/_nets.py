"""Small torch modules shared by the backend tests (imported lazily: they need torch)."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """Three parallel branches of different cost joined twice, two outputs: room to co-run."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.c = nn.Linear(16, 16)
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, x):
        s = torch.relu(self.stem(x))
        a = torch.relu(self.a(s))
        b = torch.sigmoid(self.b(s))
        c = torch.tanh(self.c(s))
        y = a + b * c
        z = torch.cat([y, s], dim=1).mean(dim=1)
        return self.head(z.flatten(1)), y.sum()
