"""ResNet-50-style network (He et al., 2016): bottleneck blocks [3, 4, 6, 3].

Published channel counts at ``width=1`` (64 ... 2048), projection shortcuts
where the shape changes.  Default input 96 x 96 keeps batch 1 fast on a small
CPU; ~175 ops after import.  Mostly a chain (width 2 at projection blocks):
the contrast case to Inception.
"""

from __future__ import annotations

import torch
from torch import nn

from opsched.zoo._layers import ConvBNReLU, PooledClassifier, eval_model, scaled

IMAGE_SIZE = 96
NUM_CLASSES = 1000


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(cin, mid, 1)
        self.conv2 = ConvBNReLU(mid, mid, 3, stride=stride, padding=1)
        self.conv3 = ConvBNReLU(mid, cout, 1, relu=False)
        self.shortcut = ConvBNReLU(cin, cout, 1, stride=stride, relu=False) if (stride != 1 or cin != cout) else None
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.shortcut(x) if self.shortcut is not None else x
        return self.relu(self.conv3(self.conv2(self.conv1(x))) + identity)


class ResNet50(PooledClassifier):
    def __init__(self, width: float = 1.0, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        c = scaled(64, width)
        self.stem = nn.Sequential(ConvBNReLU(3, c, 7, stride=2, padding=3), nn.MaxPool2d(3, stride=2, padding=1))
        blocks: list[nn.Module] = []
        for i, (n, mid) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
            m, out = scaled(mid, width), scaled(mid * 4, width)
            for j in range(n):
                blocks.append(Bottleneck(c, m, out, stride=2 if (j == 0 and i > 0) else 1))
                c = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)


def build(batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return eval_model(ResNet50(width), batch, IMAGE_SIZE)
