"""Building blocks shared by the zoo's convolutional networks."""

from __future__ import annotations

from typing import Any

from torch import nn


def scaled(channels: int, width: float, minimum: int = 4) -> int:
    """A channel count times the width multiplier (at least ``minimum``)."""
    return max(minimum, int(round(channels * width)))


class ConvBNReLU(nn.Sequential):
    """conv (no bias) -> BatchNorm -> ReLU: three ops, as every framework runs them."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1,
                 padding: int | tuple[int, int] = 0, relu: bool = True) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(cout, eps=1e-3),
        ]
        if relu:
            layers.append(nn.ReLU())
        super().__init__(*layers)


class SepConv(nn.Sequential):
    """ReLU -> depthwise k x k -> pointwise 1x1 -> BatchNorm (NASNet / RandWire)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1) -> None:
        super().__init__(
            nn.ReLU(),
            nn.Conv2d(cin, cin, kernel, stride=stride, padding=kernel // 2, groups=cin, bias=False),
            nn.Conv2d(cin, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )


def randomize_bn(module: nn.Module) -> None:
    """Give BatchNorm layers non-trivial running statistics, so eval-mode BN is a
    real affine transform (not the identity of a freshly built layer)."""
    import torch

    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            # the zoo's BN layers track running statistics (track_running_stats, the default)
            assert m.running_mean is not None and m.running_var is not None
            with torch.no_grad():
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.8, 1.2)
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.1, 0.1)


class PooledClassifier(nn.Module):
    """stem -> blocks -> global average pool -> linear: the frame of Inception and
    ResNet (subclasses build ``stem``, ``blocks``, ``pool`` and ``fc``)."""

    stem: nn.Module
    blocks: nn.Module
    pool: nn.Module
    fc: nn.Module

    def forward(self, x: Any) -> Any:
        import torch

        x = self.pool(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


def eval_model(model: nn.Module, batch: int, image_size: int) -> tuple[nn.Module, tuple[Any]]:
    """``model`` with random BatchNorm statistics, in eval mode, and a random
    image batch of ``image_size`` pixels square: what a zoo CNN's ``build`` returns."""
    import torch

    randomize_bn(model)
    return model.eval(), (torch.randn(batch, 3, image_size, image_size),)
