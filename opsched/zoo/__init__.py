"""The built-in model zoo: real network shapes in pure torch (no downloads).

Every entry builds an ``nn.Module`` in eval mode plus example inputs, with
``batch`` (the batch size) and ``width`` (a channel / hidden-size multiplier,
1.0 = the documented default).  The defaults are chosen so that each model at
batch 1 runs eagerly in a few tens of milliseconds on 2 cores and imports to
roughly 100-800 ops: a compute-heavy real network *shape* (the branching and
the op mix of the paper's network), small enough for CI.  Resolutions and
sizes are documented in each builder module.

    >>> from opsched.zoo import ZOO
    >>> module, inputs = ZOO["inception"].build(batch=1)

Builders import lazily, so reading the registry does not import torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from opsched.errors import ModelImportError


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: ``build(batch, width, seed) -> (module in eval mode, example_inputs)``."""

    name: str
    description: str
    module: str  # opsched.zoo.<module>
    factory: str

    def build(self, batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[Any, tuple]:
        """Build the module (weights drawn from ``seed``, global RNG untouched) and its inputs."""
        import torch

        if int(batch) < 1:
            raise ModelImportError(f"zoo model {self.name!r}: batch must be >= 1, got {batch}")
        if not (float(width) > 0):
            raise ModelImportError(f"zoo model {self.name!r}: width must be > 0, got {width}")
        fn = getattr(importlib.import_module(f"opsched.zoo.{self.module}"), self.factory)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module, inputs = fn(batch=int(batch), width=float(width), seed=int(seed))
        return module.eval(), tuple(inputs)

    def graph(self, batch: int = 1, width: float = 1.0, seed: int = 0):  # -> OpGraph
        """Build and import with :func:`opsched.importers.torch_fx.from_torch`."""
        from opsched.importers.torch_fx import from_torch

        module, inputs = self.build(batch, width, seed)
        return from_torch(module, inputs, name=self.name)


ZOO: dict[str, ZooModel] = {
    z.name: z
    for z in (
        ZooModel("inception", "Inception-v3-style: stem + 3xA, B, 4xC, D, 2xE parallel-branch blocks (96 px)",
                 "inception", "build"),
        ZooModel("resnet50", "ResNet-50-style: bottleneck blocks [3, 4, 6, 3] with projection shortcuts (96 px)",
                 "resnet", "build"),
        ZooModel("nasnet", "NASNet-A-style cell stack: 3x(2 normal cells) with 2 reduction cells (64 px)",
                 "nasnet", "build"),
        ZooModel("randwire", "RandWire (Xie et al.): Watts-Strogatz and Erdos-Renyi random stages, seeded (96 px)",
                 "randwire", "build"),
        ZooModel("lstm", "2-layer LSTM unrolled over 16 steps from matmuls and elementwise ops (hidden 512)",
                 "lstm", "build"),
        ZooModel("transformer", "Transformer encoder: 6 post-LN layers, 4 heads, d=256, ff=1024, 64 tokens",
                 "transformer", "build"),
    )
}


def get_zoo_model(name: str) -> ZooModel:
    """The zoo entry ``name``; an unknown name raises, listing the known ones."""
    try:
        return ZOO[name]
    except KeyError:
        raise ModelImportError(f"unknown zoo model {name!r}; the zoo has: {', '.join(ZOO)}") from None


__all__ = ["ZOO", "ZooModel", "get_zoo_model"]
