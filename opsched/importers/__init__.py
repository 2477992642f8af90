"""Importers: framework models in, :class:`~opsched.graph.OpGraph` out.

* :func:`from_torch` (``opsched.importers.torch_fx``): a PyTorch ``nn.Module``
  traced with torch.fx; the graph carries a ``TorchSource`` to run op by op.
* :func:`capture_step` (``opsched.importers.torch_step``): a PyTorch training
  step (forward, loss, backward, optimizer update) captured with make_fx, run
  by a :class:`StepRunner`; :func:`capture_inference`
  (``opsched.importers.torch_aten``): the same capture for a forward pass, for
  models torch.fx cannot trace.
* :func:`from_keras` and :func:`from_tf_function` (``opsched.importers.tf_graph``):
  TensorFlow models through their concrete function's graph.

Names resolve lazily so that importing this package pulls in neither torch
nor TensorFlow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "from_torch": "opsched.importers.torch_fx",
    "TorchSource": "opsched.importers.torch_fx",
    "CompiledOp": "opsched.importers.torch_fx",
    "Slot": "opsched.importers.torch_fx",
    "capture_step": "opsched.importers.torch_step",
    "StepRunner": "opsched.importers.torch_step",
    "capture_inference": "opsched.importers.torch_aten",
    "from_keras": "opsched.importers.tf_graph",
    "from_tf_function": "opsched.importers.tf_graph",
    "TFSource": "opsched.importers.tf_graph",
}

if TYPE_CHECKING:  # the names above, for type checkers (imported on first use at run time)
    from opsched.importers.tf_graph import TFSource, from_keras, from_tf_function
    from opsched.importers.torch_aten import capture_inference
    from opsched.importers.torch_fx import CompiledOp, Slot, TorchSource, from_torch
    from opsched.importers.torch_step import StepRunner, capture_step

#: Literal, so type checkers read it: the sorted names of ``_LAZY`` (tests/test_lazy_exports.py).
__all__ = [
    "CompiledOp", "Slot", "StepRunner", "TFSource", "TorchSource", "capture_inference", "capture_step",
    "from_keras", "from_tf_function", "from_torch",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'opsched.importers' has no attribute {name!r}")
