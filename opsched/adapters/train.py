"""PyTorch training steps on PyTorch's kernels: the apply pipeline's training mode.

A training step is a mode of the one pipeline, not a copy of it: the network
is a :class:`TrainingNetwork` (the user's module, loss function and
``torch.optim`` optimizer), the import is
:func:`opsched.importers.torch_step.capture_step` (forward, backward and the
optimizer update as one graph, phases per op), the backend runs the step graph
like any other, and the check compares one scheduled step with one eager step
taken from the same state (on copies: the user's module and optimizer are not
touched before the first real step).

What the user gets is a :class:`TrainStep`: ``loss = step(x, y)`` does what
``optimizer.zero_grad(); loss = loss_fn(module(x), y); loss.backward();
optimizer.step()`` does to ``module.state_dict()`` and
``optimizer.state_dict()`` (``p.grad`` is not filled in), and falls back to
exactly that eager step, with a :class:`ScheduleFallbackWarning`, for a call
it was not captured for.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from opsched.adapters.base import Adapter, Config, Fallback, FallbackReason, Scheduled
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.specs import TrainingNetwork, make_optimizer  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend
    from opsched.policies.base import Policy

#: The check of one scheduled step against one eager step: loss, parameters and buffers
#: elementwise; optimizer state relative to each tensor's largest entry.  On top of these,
#: each tensor may differ by twice what eager's own step differs between two intra-op
#: thread counts (:data:`SPREAD_FACTOR`; measured, zoo models at batch 4, 1 vs 2 threads:
#: inception's stem weight by 1.7e-4 of its scale, nasnet's momentum buffers by 2%, while
#: lstm and transformer are bit-identical): a plan's ops run at their own thread counts, so
#: its step is held to eager's variation, not to a fixed bound that eager fails itself.
STEP_RTOL, STEP_ATOL, STATE_REL = 1e-4, 1e-5, 1e-3
SPREAD_FACTOR = 2.0


def clone_training(net: TrainingNetwork) -> TrainingNetwork:
    """A deep copy of the module and an optimizer of the same class over its parameters, with the
    same param groups and state: a step on the copy starts from the same state as one on ``net``."""
    module = copy.deepcopy(net.module)
    index = {id(p): n for n, p in net.module.named_parameters()}
    params = dict(module.named_parameters())
    opt = net.optimizer
    groups = []
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [params[index[id(p)]] for p in g["params"]]})
    clone = type(opt)(groups)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    return TrainingNetwork(module, net.loss_fn, clone)


def eager_step(net: TrainingNetwork, x: Any, y: Any) -> torch.Tensor:
    """One eager training step; returns the loss (detached)."""
    net.optimizer.zero_grad()
    out = net.module(*x) if isinstance(x, tuple) else net.module(x)
    loss = net.loss_fn(out, y)
    loss.backward()
    net.optimizer.step()
    return loss.detach()


def _spread(want: Any, other: Any) -> float:
    """How far eager's own two steps (two thread counts) are apart in this tensor (0: not known)."""
    if not (isinstance(want, torch.Tensor) and isinstance(other, torch.Tensor)) or want.shape != other.shape \
            or not want.is_floating_point() or not want.numel():
        return 0.0
    return SPREAD_FACTOR * float((want.float() - other.float()).abs().max())


def _state_close(a: Any, b: Any, c: Any = None) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return False
        scale = float(b.detach().abs().max()) if b.numel() else 0.0
        atol = STEP_ATOL + STATE_REL * scale + _spread(b, c)
        return bool(torch.allclose(a.float(), b.float(), rtol=STEP_RTOL, atol=atol))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_state_close(a[k], b[k], c.get(k) if isinstance(c, dict) else None)
                                            for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        cs = list(c) if isinstance(c, (list, tuple)) and len(c) == len(b) else [None] * len(b)
        return len(a) == len(b) and all(_state_close(u, v, w) for u, v, w in zip(a, b, cs))
    return a == b


def same_step(got: TrainingNetwork, want: TrainingNetwork, loss: torch.Tensor, want_loss: torch.Tensor,
              spread: TrainingNetwork | None = None) -> str | None:
    """Why two networks after one step differ (loss, a parameter or buffer, optimizer state), or None.

    ``spread``: eager's step from the same state at another intra-op thread count; each tensor
    may then also differ from ``want`` by :data:`SPREAD_FACTOR` times eager's own difference."""
    if not torch.allclose(loss.float(), want_loss.float(), rtol=STEP_RTOL, atol=STEP_ATOL):
        return f"the loss {float(loss):.6g} differs from eager's {float(want_loss):.6g}"
    mine, theirs = got.module.state_dict(), want.module.state_dict()
    other = spread.module.state_dict() if spread is not None else {}
    for k, v in theirs.items():
        atol = STEP_ATOL + _spread(v, other.get(k))
        if not torch.allclose(mine[k].float(), v.float(), rtol=STEP_RTOL, atol=atol):
            return f"{k} after one step differs from eager's"
    if not _state_close(got.optimizer.state_dict()["state"], want.optimizer.state_dict()["state"],
                        spread.optimizer.state_dict()["state"] if spread is not None else None):
        return "the optimizer state after one step differs from eager's"
    return None


def eager_spread(net: TrainingNetwork, x: Any, y: Any, rng_state: torch.Tensor) -> TrainingNetwork:
    """``net`` copied and stepped eagerly at another intra-op thread count (1, or 2 when torch
    runs one thread), from the random state ``rng_state`` (the same dropout masks as the
    reference step); the global random state and thread count are left as they were."""
    copy_ = clone_training(net)
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        torch.set_num_threads(2 if threads == 1 else 1)
        try:
            eager_step(copy_, x, y)
        finally:
            torch.set_num_threads(threads)
    return copy_


class TrainStep(Scheduled):
    """A scheduled training step: ``loss = step(x, y)`` (see the module docstring)."""

    def __init__(self, network: TrainingNetwork, example: tuple, *, graph: OpGraph | None, plan: Plan | None,
                 machine: Machine, policy: Policy | None, backend: Backend | None, fallback: Fallback | None) -> None:
        self.network = network
        #: the kept plan and eager's step timed against each other at apply time (seconds; ratio plan / eager)
        self.meta_timing: dict[str, float] | None = None
        self.runner: Any = None
        if graph is not None and fallback is None:
            from opsched.importers.torch_step import StepRunner

            self.runner = StepRunner(graph, network.module, network.optimizer)
        self._hold(example, graph, plan, machine, policy, backend, fallback)

    @property
    def module(self) -> nn.Module:
        return self.network.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.network.optimizer

    def eager(self, x: Any, y: Any) -> torch.Tensor:
        """The eager step: ``zero_grad``, forward, loss, ``backward``, ``step``."""
        return eager_step(self.network, x, y)

    def __call__(self, x: Any, y: Any) -> torch.Tensor:
        if self.fallback is not None or self.runner is None:
            return self.eager(x, y)
        from opsched.importers.torch_step import StepSignatureError

        try:
            inputs = self.runner.inputs(x, y)
        except StepSignatureError as exc:
            self._warn_once(Fallback(FallbackReason.INPUTS_DIFFER, f"this call differs from the captured step: "
                                                                   f"{exc}"), "the training step")
            return self.eager(x, y)
        assert self.backend is not None and self.graph is not None and self.plan is not None
        backend, graph, plan = self.backend, self.graph, self.plan
        with torch.no_grad():
            outputs = backend.execute(graph, plan, inputs)
        return self.runner.write_back(outputs, inputs)

    def time_call(self, *xy: Any) -> float:
        t0 = time.perf_counter()
        self(*xy)
        return time.perf_counter() - t0

    def __repr__(self) -> str:
        return f"TrainStep({self._repr()})"


class TrainStepAdapter(Adapter):
    """A :class:`TrainingNetwork` on the PyTorch runtime (``torch-cpu``; ``torch-cuda`` runs the same graph)."""

    framework = "torch-train"
    tolerance = (STEP_RTOL, STEP_ATOL)

    def __init__(self, network: Any, inputs: Any, backend: str, batch: int = 1) -> None:
        if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
            raise TypeError("opsched.train_step: example inputs are (example_x, example_y)")
        super().__init__(network, tuple(inputs), backend, batch)
        self._checked: TrainingNetwork | None = None

    @property
    def label(self) -> str:
        return f"{type(self.network.module).__name__} training step"

    def import_graph(self) -> OpGraph:
        from opsched.importers.torch_step import capture_step

        x, y = self.inputs
        net = self.network
        return capture_step(net.module, net.loss_fn, net.optimizer, x, y, name=type(net.module).__name__)

    def feeds(self, graph: OpGraph) -> tuple:
        """The graph inputs of one step from the current state (built on a copy)."""
        from opsched.importers.torch_step import StepRunner

        copy_ = clone_training(self.network)
        return StepRunner(graph, copy_.module, copy_.optimizer).inputs(*self.inputs)

    def reference(self, graph: OpGraph, feeds: tuple) -> Any:
        """One eager step on a copy: (copy after the step, its loss, the same step at another thread
        count: eager's own variation, :func:`same_step`'s ``spread``)."""
        net = clone_training(self.network)
        state = torch.get_rng_state()
        x, y = self.inputs
        loss = eager_step(net, x, y)
        return net, loss, eager_spread(self.network, x, y, state)

    def check_run(self, backend: Backend, graph: OpGraph, plan: Plan, feeds: tuple, reference: Any) -> str | None:
        from opsched.importers.torch_step import StepRunner

        want, want_loss, spread = reference
        got = clone_training(self.network)
        runner = StepRunner(graph, got.module, got.optimizer)
        inputs = runner.inputs(*self.inputs)
        with torch.no_grad():
            loss = runner.write_back(backend.execute(graph, plan, inputs), inputs)
        return same_step(got, want, loss, want_loss, spread)

    def eager_description(self) -> str:
        return self.label

    def choose(self, graph: OpGraph, plan: Plan, found: dict[str, tuple[Plan, float]] | None, machine: Machine,
               model: Any, policy: Any) -> tuple[Plan, dict[str, tuple[Plan, float]] | None]:
        """A policy that offers candidates (the learned policy) also gets every baseline heuristic's plan
        as one: a training step's ops are many and the planning model's error on them is large (the
        moldable-task heuristics - CPA, biCPA, LP rounding - often win for real), so the measured
        choice picks among them all.  A heuristic asked for by name is planned as it is."""
        if found is None:
            return plan, None
        from opsched.engine.sim import Simulator
        from opsched.policies import BASELINE, get_policy, names

        sim = Simulator(machine, model)
        more = dict(found)
        for name in names(BASELINE):
            key = f"heuristic:{name}"
            if key not in more:
                p = get_policy(name).plan(graph, machine, model)
                more[key] = (p, sim.makespan(graph, p))
        return plan, more

    #: The kept plan must beat eager's step by this share (per-round ratio, median) or eager runs:
    #: the plan pays a replay of every op from Python that eager's C++ autograd engine does not.
    EAGER_MARGIN = 0.02

    def against_framework(self, scheduled: Scheduled) -> Fallback | None:
        """Time the scheduled step against eager's (each on its own copy, interleaved rounds, each
        call after the last one's threads went quiet); eager runs when it is faster here."""
        from opsched.timing import interleave

        if not isinstance(scheduled, TrainStep) or scheduled.fallback is not None:
            return None
        configs = {"plan": self.timer(scheduled, ()), "eager": _eager_timer(clone_training(self.network), self.inputs,
                                                                             None)}
        t = interleave(configs, warmup=1, repeats=5)
        ratio = t.ratios("eager")["plan"]["median"]  # the plan's time over eager's, round by round
        scheduled.meta_timing = {"plan_s": t.median("plan"), "eager_s": t.median("eager"), "ratio": ratio}
        if ratio > 1.0 - self.EAGER_MARGIN:
            return Fallback(FallbackReason.FRAMEWORK_FASTER,
                            f"eager PyTorch ran this step in {t.median('eager') * 1e3:.1f} ms against the plan's "
                            f"{t.median('plan') * 1e3:.1f} ms here, so the eager step runs")
        return None

    def wrap(self, graph: OpGraph | None, plan: Plan | None, machine: Machine, policy: Policy | None,
             backend: Backend | None, fallback: Fallback | None, feeds: tuple, reference: Any = None) -> Scheduled:
        return TrainStep(self.network, self.inputs, graph=graph, plan=plan, machine=machine, policy=policy,
                         backend=backend, fallback=fallback)

    def configs(self, graph: OpGraph, feeds: tuple, backend: Backend, machine: Machine) -> dict[str, Config]:
        """Eager training steps at torch's default threads and at one thread, each on its own copy."""
        default = torch.get_num_threads()
        out = {"eager": Config(_eager_timer(clone_training(self.network), self.inputs, None),
                               f"torch default ({default} threads)")}
        if default > 1:
            out["eager-1-thread"] = Config(_eager_timer(clone_training(self.network), self.inputs, 1),
                                           "torch, 1 intra-op thread")
        return out

    def timer(self, scheduled: Scheduled, feeds: tuple) -> Callable[[], float]:
        """A scheduled step on its own copy (the user's module is not trained by timing)."""
        if not isinstance(scheduled, TrainStep) or scheduled.fallback is not None:
            return _eager_timer(clone_training(self.network), self.inputs, None)
        twin = TrainStep(clone_training(self.network), self.inputs, graph=scheduled.graph, plan=scheduled.plan,
                         machine=scheduled.machine, policy=scheduled.policy, backend=scheduled.backend, fallback=None)
        return lambda: twin.time_call(*self.inputs)

    def note(self) -> str | None:
        return ("train: '= eager' compares one scheduled step with one eager step from the same state (loss, "
                "every parameter and buffer, the optimizer state); rows time full steps on copies of the model")


def _eager_timer(net: TrainingNetwork, xy: Sequence[Any], threads: int | None) -> Callable[[], float]:
    def once() -> float:
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            eager_step(net, *xy)
            return time.perf_counter() - t0
        finally:
            if threads is not None:
                torch.set_num_threads(before)

    return once


__all__ = ["STEP_ATOL", "STEP_RTOL", "TrainStep", "TrainStepAdapter", "TrainingNetwork", "clone_training",
           "eager_spread", "eager_step", "make_optimizer", "same_step"]
