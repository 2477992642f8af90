"""PyTorch modules on PyTorch's own kernels (``torch-cpu``, ``torch-cuda``): the adapter and the scheduled module.

The module is traced with torch.fx (:func:`opsched.importers.torch_fx.from_torch`);
the scheduled outputs must equal ``module(*inputs)`` under ``torch.no_grad``
(:data:`RTOL`, :data:`ATOL`: thread counts change float summation order); the
framework's own configuration is eager PyTorch at its default threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from opsched.adapters.base import Adapter, Config, Fallback, FallbackReason, Scheduled
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend
    from opsched.policies.base import Policy

#: Output tolerance of the check against eager for PyTorch (thread counts change
#: float summation order; the runtime's own tests use the same bounds).
RTOL, ATOL = 1e-4, 1e-5
#: On ``torch-cuda`` the scheduled outputs (GPU kernels, TF32 off) are checked against the CPU module's.
CUDA_RTOL, CUDA_ATOL = 1e-3, 1e-4


def why_torch_eager(scheduled: Scheduled, module: nn.Module | None, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> Fallback | None:
    """Why a call of a PyTorch-facing scheduled model cannot run the Plan, or None."""
    if scheduled.fallback is not None:
        return scheduled.fallback
    if kwargs:
        return Fallback(FallbackReason.KEYWORDS, f"keyword arguments ({', '.join(kwargs)}) were not part of the "
                                                 "planned call")
    if module is not None and module.training:
        return Fallback(FallbackReason.TRAINING_MODE, "the module is in training mode (the Plan was made for eval "
                                                      "mode; opsched.train_step schedules training steps)")
    why = scheduled._why_inputs(args)
    if why is None and torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                       for x in args):
        why = Fallback(FallbackReason.REQUIRES_GRAD, "an input requires grad (the scheduled path is inference "
                                                     "only; opsched.train_step schedules training steps)")
    return why


class ScheduledModule(nn.Module, Scheduled):
    """``module`` whose ``forward`` runs a Plan on the PyTorch runtime (CPU executors or CUDA streams)."""

    def __init__(self, module: nn.Module, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Backend | None, fallback: Fallback | None) -> None:
        super().__init__()
        self.module = module
        self._hold(example_inputs, graph, plan, machine, policy, backend, fallback)

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Fallback | None:
        """Why this call cannot take the scheduled path, or None."""
        return why_torch_eager(self, self.module, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback:
                self._warn_once(why, type(self.module).__name__)
            return self.module(*args, **kwargs)
        assert self.backend is not None and self.graph is not None and self.plan is not None
        return self.backend.execute(self.graph, self.plan, args)

    def time_call(self, *inputs: Any) -> float:
        """Wall seconds of one inference (under ``torch.no_grad``)."""
        with torch.no_grad():
            t0 = time.perf_counter()
            self(*inputs)
            return time.perf_counter() - t0

    def extra_repr(self) -> str:
        return self._repr()


def eager_timer(module: nn.Module, inputs: Sequence[Any]) -> Callable[[], float]:
    """Seconds of one eager inference of ``module`` (under ``torch.no_grad``)."""
    def once() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            module(*inputs)
            return time.perf_counter() - t0

    return once


class TorchAdapter(Adapter):
    """A PyTorch module in eval mode on the PyTorch runtime."""

    framework = "torch"
    tolerance = (RTOL, ATOL)

    def __init__(self, network: Any, inputs: tuple, backend: str, batch: int = 1) -> None:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        super().__init__(network, tuple(inputs or ()), backend, batch)
        if backend == "torch-cuda":  # cuDNN / cuBLAS kernels against the CPU module's
            self.tolerance = (CUDA_RTOL, CUDA_ATOL)

    def refuse(self) -> Fallback | None:
        if self.network.training:
            return Fallback(FallbackReason.TRAINING_MODE, "the module is in training mode; call module.eval() "
                                                          "before opsched.apply (opsched.train_step schedules "
                                                          "training steps)")
        return None

    def import_graph(self) -> OpGraph:
        from opsched.importers.torch_fx import from_torch

        return from_torch(self.network, self.inputs, name=self.label)

    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        with torch.no_grad():
            return self.network(*feeds)

    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        return ScheduledModule(self.network, feeds, graph=graph, plan=plan, machine=machine, policy=policy,
                               backend=backend, fallback=fallback)

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        return {"eager": Config(eager_timer(self.network, feeds), f"torch default ({torch.get_num_threads()} threads)")}


__all__ = ["ATOL", "RTOL", "ScheduledModule", "TorchAdapter", "eager_timer", "why_torch_eager"]
