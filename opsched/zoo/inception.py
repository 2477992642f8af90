"""Inception-v3-style network (Szegedy et al., 2016), the Graphi paper's widest CNN.

Same block structure as Inception-v3 (stem, 3 x InceptionA, InceptionB,
4 x InceptionC, InceptionD, 2 x InceptionE, each a set of parallel conv
branches concatenated), with the published channel counts at ``width=1``.
Default input 96 x 96 (Inception-v3's minimum is 75) keeps batch 1 fast on a
small CPU while keeping every branch; ~310 ops after import.
"""

from __future__ import annotations

import torch
from torch import nn

from opsched.zoo._layers import ConvBNReLU, PooledClassifier, eval_model, scaled

IMAGE_SIZE = 96
NUM_CLASSES = 1000


class _Block(nn.Module):
    """An Inception block; ``out_channels``: the channels of its concatenated output."""

    out_channels: int


class InceptionA(_Block):
    def __init__(self, cin: int, pool: int, w: float) -> None:
        super().__init__()
        c64, c48, c96 = scaled(64, w), scaled(48, w), scaled(96, w)
        self.b1 = ConvBNReLU(cin, c64, 1)
        self.b5_1 = ConvBNReLU(cin, c48, 1)
        self.b5_2 = ConvBNReLU(c48, c64, 5, padding=2)
        self.b3_1 = ConvBNReLU(cin, c64, 1)
        self.b3_2 = ConvBNReLU(c64, c96, 3, padding=1)
        self.b3_3 = ConvBNReLU(c96, c96, 3, padding=1)
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.bp = ConvBNReLU(cin, scaled(pool, w), 1)
        self.out_channels = c64 + c64 + c96 + scaled(pool, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b5_2(self.b5_1(x)), self.b3_3(self.b3_2(self.b3_1(x))),
                          self.bp(self.pool(x))], 1)


class InceptionB(_Block):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        c384, c64, c96 = scaled(384, w), scaled(64, w), scaled(96, w)
        self.b3 = ConvBNReLU(cin, c384, 3, stride=2)
        self.bd_1 = ConvBNReLU(cin, c64, 1)
        self.bd_2 = ConvBNReLU(c64, c96, 3, padding=1)
        self.bd_3 = ConvBNReLU(c96, c96, 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c384 + c96 + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.bd_3(self.bd_2(self.bd_1(x))), self.pool(x)], 1)


class InceptionC(_Block):
    def __init__(self, cin: int, c7: int, w: float) -> None:
        super().__init__()
        c192, c7 = scaled(192, w), scaled(c7, w)
        self.b1 = ConvBNReLU(cin, c192, 1)
        self.b7 = nn.Sequential(ConvBNReLU(cin, c7, 1), ConvBNReLU(c7, c7, (1, 7), padding=(0, 3)),
                                ConvBNReLU(c7, c192, (7, 1), padding=(3, 0)))
        self.b7d = nn.Sequential(ConvBNReLU(cin, c7, 1), ConvBNReLU(c7, c7, (7, 1), padding=(3, 0)),
                                 ConvBNReLU(c7, c7, (1, 7), padding=(0, 3)),
                                 ConvBNReLU(c7, c7, (7, 1), padding=(3, 0)),
                                 ConvBNReLU(c7, c192, (1, 7), padding=(0, 3)))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.bp = ConvBNReLU(cin, c192, 1)
        self.out_channels = 4 * c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b7(x), self.b7d(x), self.bp(self.pool(x))], 1)


class InceptionD(_Block):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        c192, c320 = scaled(192, w), scaled(320, w)
        self.b3 = nn.Sequential(ConvBNReLU(cin, c192, 1), ConvBNReLU(c192, c320, 3, stride=2))
        self.b7 = nn.Sequential(ConvBNReLU(cin, c192, 1), ConvBNReLU(c192, c192, (1, 7), padding=(0, 3)),
                                ConvBNReLU(c192, c192, (7, 1), padding=(3, 0)),
                                ConvBNReLU(c192, c192, 3, stride=2))
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c320 + c192 + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b3(x), self.b7(x), self.pool(x)], 1)


class InceptionE(_Block):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        c320, c384, c448, c192 = scaled(320, w), scaled(384, w), scaled(448, w), scaled(192, w)
        self.b1 = ConvBNReLU(cin, c320, 1)
        self.b3_1 = ConvBNReLU(cin, c384, 1)
        self.b3_2a = ConvBNReLU(c384, c384, (1, 3), padding=(0, 1))
        self.b3_2b = ConvBNReLU(c384, c384, (3, 1), padding=(1, 0))
        self.bd_1 = ConvBNReLU(cin, c448, 1)
        self.bd_2 = ConvBNReLU(c448, c384, 3, padding=1)
        self.bd_3a = ConvBNReLU(c384, c384, (1, 3), padding=(0, 1))
        self.bd_3b = ConvBNReLU(c384, c384, (3, 1), padding=(1, 0))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.bp = ConvBNReLU(cin, c192, 1)
        self.out_channels = c320 + 4 * c384 + c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.b3_1(x)
        d = self.bd_2(self.bd_1(x))
        return torch.cat([self.b1(x), self.b3_2a(a), self.b3_2b(a), self.bd_3a(d), self.bd_3b(d),
                          self.bp(self.pool(x))], 1)


class InceptionV3(PooledClassifier):
    def __init__(self, width: float = 1.0, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            ConvBNReLU(3, scaled(32, w), 3, stride=2), ConvBNReLU(scaled(32, w), scaled(32, w), 3),
            ConvBNReLU(scaled(32, w), scaled(64, w), 3, padding=1), nn.MaxPool2d(3, stride=2),
            ConvBNReLU(scaled(64, w), scaled(80, w), 1), ConvBNReLU(scaled(80, w), scaled(192, w), 3),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: list[_Block] = []
        c = scaled(192, w)
        for pool in (32, 64, 64):
            blocks.append(InceptionA(c, pool, w))
            c = blocks[-1].out_channels
        blocks.append(InceptionB(c, w))
        c = blocks[-1].out_channels
        for c7 in (128, 160, 160, 192):
            blocks.append(InceptionC(c, c7, w))
            c = blocks[-1].out_channels
        blocks.append(InceptionD(c, w))
        c = blocks[-1].out_channels
        for _ in range(2):
            blocks.append(InceptionE(c, w))
            c = blocks[-1].out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)


def build(batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return eval_model(InceptionV3(width), batch, IMAGE_SIZE)
