"""NASNet-A-style cell stack (Zoph et al., 2018), the cells of NASNet-A Mobile.

Stem conv, then three stages of ``N`` normal cells separated by two reduction
cells; every cell combines its two inputs (the previous two cells' outputs)
through five pairwise-summed branches of separable convolutions, pooling and
identities, concatenated - many small independent ops, the shape that benefits
most from co-running.  Defaults: ``N = 2``, ``F = 44`` filters at ``width=1``
(NASNet-A Mobile's penultimate filter count), input 64 x 64; ~460 ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opsched.zoo._layers import SepConv, eval_model, scaled

IMAGE_SIZE = 64
CELLS_PER_STAGE = 2
FILTERS = 44
NUM_CLASSES = 1000


def relu_conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))


class BranchSep(nn.Sequential):
    """NASNet's separable branch: two stacked separable convs (stride on the first)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1) -> None:
        super().__init__(SepConv(cin, cout, kernel, stride), SepConv(cout, cout, kernel))


class FactorizedReduce(nn.Module):
    """Halve a previous cell's output spatially: two offset strided 1x1 paths, concatenated."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.pool = nn.AvgPool2d(1, stride=2)
        self.path1 = nn.Conv2d(cin, cout // 2, 1, bias=False)
        self.path2 = nn.Conv2d(cin, cout - cout // 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.path1(self.pool(x)), self.path2(self.pool(shifted))], 1))


def avg3(stride: int = 1) -> nn.AvgPool2d:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


class NormalCell(nn.Module):
    def __init__(self, c_prev: int, c_cur: int, f: int, prev_reduced: bool) -> None:
        super().__init__()
        self.adjust_prev = FactorizedReduce(c_prev, f) if prev_reduced else relu_conv_bn(c_prev, f)
        self.adjust_cur = relu_conv_bn(c_cur, f)
        self.c0_left, self.c0_right = BranchSep(f, f, 5), BranchSep(f, f, 3)
        self.c1_left, self.c1_right = BranchSep(f, f, 5), BranchSep(f, f, 3)
        self.c2_pool = avg3()
        self.c3_pool_a, self.c3_pool_b = avg3(), avg3()
        self.c4_sep = BranchSep(f, f, 3)
        self.out_channels = 6 * f

    def forward(self, prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        left, right = self.adjust_prev(prev), self.adjust_cur(cur)
        c0 = self.c0_left(right) + self.c0_right(left)
        c1 = self.c1_left(left) + self.c1_right(left)
        c2 = self.c2_pool(right) + left
        c3 = self.c3_pool_a(left) + self.c3_pool_b(left)
        c4 = self.c4_sep(right) + right
        return torch.cat([left, c0, c1, c2, c3, c4], 1)


class ReductionCell(nn.Module):
    def __init__(self, c_prev: int, c_cur: int, f: int, prev_reduced: bool) -> None:
        super().__init__()
        self.adjust_prev = FactorizedReduce(c_prev, f) if prev_reduced else relu_conv_bn(c_prev, f)
        self.adjust_cur = relu_conv_bn(c_cur, f)
        self.c0_left, self.c0_right = BranchSep(f, f, 5, 2), BranchSep(f, f, 7, 2)
        self.c1_pool, self.c1_right = nn.MaxPool2d(3, stride=2, padding=1), BranchSep(f, f, 7, 2)
        self.c2_pool, self.c2_right = avg3(2), BranchSep(f, f, 5, 2)
        self.c3_pool = avg3()
        self.c4_sep, self.c4_pool = BranchSep(f, f, 3), nn.MaxPool2d(3, stride=2, padding=1)
        self.out_channels = 4 * f

    def forward(self, prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        left, right = self.adjust_cur(cur), self.adjust_prev(prev)
        c0 = self.c0_left(left) + self.c0_right(right)
        c1 = self.c1_pool(left) + self.c1_right(right)
        c2 = self.c2_pool(left) + self.c2_right(right)
        c3 = self.c3_pool(c0) + c1
        c4 = self.c4_sep(c0) + self.c4_pool(left)
        return torch.cat([c1, c2, c3, c4], 1)


class NASNet(nn.Module):
    def __init__(self, width: float = 1.0, n: int = CELLS_PER_STAGE, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        f = scaled(FILTERS, width)
        stem_c = scaled(32, width)
        self.stem = nn.Sequential(nn.Conv2d(3, stem_c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(stem_c))
        cells: list[nn.Module] = []
        c_prev = c_cur = stem_c
        prev_reduced = False  # does the cell's `prev` input have twice its `cur` input's resolution?
        for stage in range(3):
            if stage > 0:
                cell = ReductionCell(c_prev, c_cur, f * 2**stage, prev_reduced)
                cells.append(cell)
                c_prev, c_cur, prev_reduced = c_cur, cell.out_channels, True
            for _ in range(n):
                cell = NormalCell(c_prev, c_cur, f * 2**stage, prev_reduced)
                cells.append(cell)
                c_prev, c_cur, prev_reduced = c_cur, cell.out_channels, False
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_cur, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = cur = self.stem(x)
        for cell in self.cells:
            prev, cur = cur, cell(prev, cur)
        return self.fc(torch.flatten(self.pool(self.relu(cur)), 1))


def build(batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return eval_model(NASNet(width), batch, IMAGE_SIZE)
