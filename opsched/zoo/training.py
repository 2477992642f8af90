"""The zoo in training mode: each model's default loss and example targets.

A training step needs a loss and targets besides the model and its inputs.
The classifiers (inception, resnet50, nasnet, randwire, lstm) end in class
logits ``(batch, classes)``: cross-entropy against random class indices.  The
transformer encoder ends in hidden states ``(batch, tokens, d_model)`` with no
head: mean squared error against a random tensor of that shape (a regression
target; it exercises the whole encoder's backward without inventing a head).

    >>> from opsched.zoo.training import build_train
    >>> ex = build_train("randwire", batch=4)
    >>> loss = ex.loss_fn(ex.module(*ex.inputs), ex.targets)

BatchNorm in training mode normalises over the batch, so models that have it
need ``batch >= 2`` (one sample gives a zero variance wherever a channel has
one value per sample, and torch refuses it); :func:`build_train` says so
instead of failing inside the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opsched.errors import ModelImportError

#: Default loss per zoo model: the name of a ``torch.nn.functional`` loss.
DEFAULT_LOSSES: dict[str, str] = {
    "inception": "cross_entropy",
    "resnet50": "cross_entropy",
    "nasnet": "cross_entropy",
    "randwire": "cross_entropy",
    "lstm": "cross_entropy",
    "transformer": "mse_loss",
}


@dataclass(frozen=True)
class TrainExample:
    """A zoo model ready for a training step: module in train mode, inputs, targets, loss."""

    name: str
    module: Any
    inputs: tuple
    targets: Any
    loss_fn: Callable[[Any, Any], Any]


def default_loss(name: str) -> Callable[[Any, Any], Any]:
    """The default loss function of zoo model ``name`` (a ``torch.nn.functional`` function)."""
    import torch.nn.functional as F

    from opsched.zoo import get_zoo_model

    get_zoo_model(name)  # unknown names raise, listing the zoo
    loss = DEFAULT_LOSSES.get(name)
    if loss is None:
        raise ModelImportError(f"zoo model {name!r} has no default loss; pass loss_fn yourself")
    return getattr(F, loss)


def _output_shape(module: Any, inputs: tuple) -> tuple[int, ...]:
    """The module's output shape, from a run on fake tensors (no arithmetic, no state change)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    was = module.training
    module.eval()  # eval: BatchNorm must not write fake values into real buffers
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            out = module(*(mode.from_tensor(x) for x in inputs))
    finally:
        module.train(was)
    return tuple(int(d) for d in out.shape)


def example_targets(name: str, module: Any, inputs: tuple, seed: int = 0) -> Any:
    """Random targets for zoo model ``name`` that its default loss accepts
    (drawn from their own generator: the global RNG is untouched)."""
    import torch

    shape = _output_shape(module, inputs)
    gen = torch.Generator().manual_seed(seed + 1)
    if DEFAULT_LOSSES.get(name) == "cross_entropy":
        if len(shape) != 2:
            raise ModelImportError(f"zoo model {name!r}: expected class logits (batch, classes), got {shape}")
        return torch.randint(0, shape[1], (shape[0],), generator=gen)
    return torch.randn(shape, generator=gen)


def needs_batch_of_two(module: Any) -> bool:
    """Whether ``module`` has BatchNorm layers (train-mode statistics need batch >= 2)."""
    from torch import nn

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def build_train(name: str, batch: int = 2, width: float = 1.0, seed: int = 0) -> TrainExample:
    """Zoo model ``name`` in train mode with example inputs, targets and its default loss."""
    from opsched.zoo import get_zoo_model

    module, inputs = get_zoo_model(name).build(batch, width, seed)
    if int(batch) < 2 and needs_batch_of_two(module):
        raise ModelImportError(f"zoo model {name!r} in train mode needs batch >= 2, got {batch}: its BatchNorm "
                               "layers normalise over the batch, which one sample cannot do")
    targets = example_targets(name, module, inputs, seed)
    return TrainExample(name, module.train(), inputs, targets, default_loss(name))


__all__ = ["DEFAULT_LOSSES", "TrainExample", "build_train", "default_loss", "example_targets", "needs_batch_of_two"]
