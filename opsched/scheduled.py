"""``opsched.apply(policy, module, example_inputs) -> ScheduledModule`` (defined here,
re-exported lazily by ``opsched/__init__.py`` so ``import opsched`` stays torch-free).

Runs a PyTorch model under a schedule at inference time: the module is
imported into an OpGraph (torch.fx), the policy plans it for this machine --
with the fitted performance model when profiles of this machine are cached,
else the analytic one -- and the returned :class:`ScheduledModule` is an
``nn.Module`` whose ``forward`` executes that Plan on the real PyTorch CPU
runtime (:class:`~opsched.backends.torch_cpu.TorchCPUBackend`).

Correctness comes first.  The scheduled path is checked once against eager
execution on the example inputs, and every call checks that its inputs have
the shapes, dtypes and devices the Plan was made for.  Whenever the policy
cannot plan (graph too large after coarsening, a policy file in the wrong
format, a machine it was not trained for), the model cannot be traced, the
check fails, or a call's inputs differ from the planned ones, the module says
so with a :class:`ScheduleFallbackWarning` and runs eagerly: slower, never
wrong.  Plans are cached by (policy, graph fingerprint, machine fingerprint,
performance model), so applying the same model twice plans once.

The scheduled path is inference only: it runs under ``torch.no_grad`` and its
outputs carry no autograd graph (a call whose inputs require grad, or a module
in training mode, runs eagerly).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opsched.errors import OpschedError, PolicyError
from opsched.graph import OpGraph
from opsched.machine import Machine, get_machine
from opsched.plan import Plan
from opsched.policies.base import Policy
from opsched.policies.exported import pretrained_path

#: Output tolerance of the one-time check against eager (thread counts change
#: float summation order; the runtime's own tests use the same bounds).
RTOL, ATOL = 1e-4, 1e-5

_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_PLANS_MAX = 64
_BACKENDS: dict[str, Any] = {}
_LOCK = threading.Lock()


class ScheduleFallbackWarning(UserWarning):
    """The scheduled path is not used (the message says why); the module runs eagerly."""


def resolve_policy(policy: Policy | str | Path | None) -> Policy:
    """A Policy object as is; ``None`` the pretrained policy; a string a
    registered heuristic name (``"critical-path-first"``) or an exported
    policy's path."""
    from opsched.policies import get_policy, load

    if policy is None:
        return load(pretrained_path())
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Path):
        return load(policy)
    return get_policy(str(policy))


def performance_model(machine: Machine) -> Any:
    """The fitted model when this machine has cached profiles (``opsched
    profile``), else the analytic one."""
    try:
        from opsched.backends.fitted import fitted_or_analytic
    except ImportError:
        from opsched.backends.perfmodel import default_model

        return default_model()
    return fitted_or_analytic(machine)


def policy_key(policy: Policy) -> str:
    """What identifies a policy's decisions in the plan cache."""
    digest = getattr(policy, "digest", None)
    return f"{policy.name}:{digest}" if digest else policy.name


def plan_cached(policy: Policy, graph: OpGraph, machine: Machine, model: Any = None) -> Plan:
    """``policy.plan(graph, machine, model)``, cached by policy, graph and
    machine fingerprint and the model's type."""
    key = (policy_key(policy), graph.fingerprint(), machine.fingerprint(), type(model).__name__)
    with _LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    plan = policy.plan(graph, machine, model)
    with _LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    return plan


def shared_backend(machine: Machine) -> Any:
    """One TorchCPUBackend per machine for every ScheduledModule (one worker
    pool, not one per model; concurrent runs queue up)."""
    from opsched.backends.torch_cpu import TorchCPUBackend

    fp = machine.fingerprint()
    with _LOCK:
        be = _BACKENDS.get(fp)
        if be is None:
            be = _BACKENDS[fp] = TorchCPUBackend(machine)
        return be


def cpu_only(machine: Machine) -> Machine:
    """``machine`` without its GPUs: the PyTorch CPU runtime runs every op on the CPU."""
    if not machine.gpus:
        return machine
    return Machine(name=machine.name, devices=(machine.cpu,), links=(),
                   description=f"{machine.description} (CPU only: the torch-cpu runtime)", source=machine.source)


def _signature(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.layout)
    return ("value", type(x).__name__, repr(x))


def outputs_close(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """Same structure, and every tensor of the same shape and dtype and allclose."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(outputs_close(x, y, rtol, atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(outputs_close(a[k], b[k], rtol, atol) for k in a)
    return a == b


class ScheduledModule(nn.Module):
    """``module`` whose ``forward`` runs a Plan on the PyTorch CPU runtime.

    Attributes: ``module`` (the wrapped module), ``graph``, ``plan``,
    ``machine``, ``policy`` and ``fallback_reason`` (None while the scheduled
    path is in use; else why every call runs eagerly).  Build with
    :func:`apply`.
    """

    def __init__(self, module: nn.Module, example_inputs: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Any, fallback_reason: str | None) -> None:
        super().__init__()
        self.module = module
        self.graph, self.plan, self.machine, self.policy = graph, plan, machine, policy
        self.backend = backend
        self.fallback_reason = fallback_reason
        self._signature = tuple(_signature(x) for x in example_inputs)
        self._warned: set[str] = set()

    @property
    def scheduled(self) -> bool:
        """True while calls with the planned inputs run the Plan."""
        return self.fallback_reason is None

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"opsched.apply: {reason}; running {type(self.module).__name__} eagerly",
                          ScheduleFallbackWarning, stacklevel=3)

    def why_eager(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """Why this call cannot take the scheduled path, or None."""
        if self.fallback_reason is not None:
            return self.fallback_reason
        if kwargs:
            return f"keyword arguments ({', '.join(kwargs)}) were not part of the planned call"
        if self.module.training:
            return "the module is in training mode (the Plan was made for eval mode)"
        sig = tuple(_signature(x) for x in args)
        if sig != self._signature:
            return (f"the inputs {_describe(sig)} differ from the planned {_describe(self._signature)} "
                    "(apply again with example inputs of the new shape)")
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args):
            return "an input requires grad (the scheduled path is inference only)"
        return None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        why = self.why_eager(args, kwargs)
        if why is not None:
            if why is not self.fallback_reason:
                self._warn_once(why)
            return self.module(*args, **kwargs)
        return self.backend.execute(self.graph, self.plan, *args)

    def extra_repr(self) -> str:
        if self.plan is None:
            return f"eager (fallback: {self.fallback_reason})"
        return (f"policy={self.plan.policy!r}, machine={self.machine.name!r}, ops={len(self.graph.ops)}"
                + ("" if self.scheduled else f", eager (fallback: {self.fallback_reason})"))


def _describe(sig: tuple) -> str:
    parts = []
    for s in sig:
        if s[0] == "tensor":
            parts.append(f"{str(s[2]).removeprefix('torch.')}{list(s[1])}@{s[3]}")
        else:
            parts.append(f"{s[1]} {s[2]}")
    return "(" + ", ".join(parts) + ")"


def apply(policy: Policy | str | Path | None, module: nn.Module, example_inputs: Any, *,
          machine: Machine | str | None = None, model: Any = None, verify: bool = True) -> ScheduledModule:
    """Plan ``module`` with ``policy`` and return a :class:`ScheduledModule`.

    ``policy``: an exported policy's folder, a Policy object, a heuristic's
    name, or None for the shipped pretrained policy.  ``example_inputs``: a
    tensor or a tuple of them, with the shapes later calls will use.
    ``machine``: this machine by default (probed; the runtime executes here).
    ``model``: the performance model to plan with (default: fitted from
    cached profiles, else analytic).  ``verify``: run the Plan once on the
    example inputs and compare with eager execution.

    Never raises for a model it cannot schedule: the result then runs eagerly
    and a :class:`ScheduleFallbackWarning` says why (errors in the arguments
    themselves -- not a module, an unknown machine -- still raise)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"opsched.apply: expected a torch.nn.Module, got {type(module).__name__}")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    machine = get_machine(machine if machine is not None else "local")
    pol: Policy | None = None

    def fallback(reason: str, graph: OpGraph | None = None, plan: Plan | None = None) -> ScheduledModule:
        warnings.warn(f"opsched.apply: {reason}; running {type(module).__name__} eagerly",
                      ScheduleFallbackWarning, stacklevel=3)
        return ScheduledModule(module, inputs, graph=graph, plan=plan, machine=machine, policy=pol,
                               backend=None, fallback_reason=reason)

    try:
        pol = resolve_policy(policy)
    except PolicyError as exc:
        return fallback(f"cannot use the policy: {exc}")
    if module.training:
        return fallback("the module is in training mode; call module.eval() before opsched.apply")
    machine = cpu_only(machine)
    from opsched.importers.torch_fx import from_torch

    try:
        graph = from_torch(module, inputs, name=type(module).__name__)
    except OpschedError as exc:
        return fallback(f"cannot import the model: {exc}")
    model = performance_model(machine) if model is None else model
    try:
        plan = plan_cached(pol, graph, machine, model)
    except (OpschedError, ValueError) as exc:
        return fallback(f"the policy cannot plan this graph: {exc}", graph)
    backend = shared_backend(machine)
    if verify:
        try:
            with torch.no_grad():
                ref = module(*inputs)
                out = backend.execute(graph, plan, *inputs)
        except OpschedError as exc:
            return fallback(f"the scheduled run failed: {exc}", graph, plan)
        if not outputs_close(out, ref):
            return fallback("the scheduled run's outputs differ from eager execution", graph, plan)
    return ScheduledModule(module, inputs, graph=graph, plan=plan, machine=machine, policy=pol,
                           backend=backend, fallback_reason=None)


__all__ = ["ScheduleFallbackWarning", "ScheduledModule", "apply", "cpu_only", "outputs_close", "performance_model",
           "plan_cached", "pretrained_path", "resolve_policy"]
