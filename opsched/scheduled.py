"""``opsched.apply(policy, network, example_inputs)``: a network that runs under a schedule.

One pipeline for every backend, in one order:

1. **import** -- the backend's adapter (:mod:`opsched.adapters`, chosen from the
   backend registry by the network's framework) imports the network into an
   OpGraph and gives the inputs the backend runs and the reference outputs
   (the framework's own execution) they must equal;
2. **plan** -- the policy plans the graph with the planning model, resolved
   once (:func:`opsched.planning.planning_model`: the fitted performance model
   plus the backend's runtime model when ``opsched profile`` made them, else
   the analytic one); each policy is planned once per graph and machine;
3. **time the shortlist** -- the planning model's best few candidates (a
   learned policy's decodings and the heuristics; on ``ort`` the lowered plan
   and ONNX Runtime's one session) are timed on the backend, each call after
   the previous one's threads went quiet (:func:`opsched.timing.settle`), and
   the fastest is kept (:mod:`opsched.measured`);
4. **check once** -- the kept plan runs on the example inputs and its outputs
   are compared with the reference (:func:`opsched.adapters.base.outputs_equal`);
5. **wrap** -- the adapter's scheduled model (:class:`ScheduledModule`,
   :class:`ScheduledKeras`, :class:`ScheduledOnnx`), which checks the inputs
   of every call against those it was planned for;
6. **fall back with a reason** -- any step that cannot go on returns the
   network running eagerly, with a :class:`ScheduleFallbackWarning` and a
   :class:`~opsched.adapters.base.Fallback` (a :class:`FallbackReason` and a
   sentence): slower, never wrong.

:func:`prepare` does steps 1 and the planning-model choice once for a
network, and :func:`schedule` steps 2-6 for one policy, so ``opsched apply``
schedules critical-path-first and the policy from one import.  The scheduled
path is inference only (it runs under ``torch.no_grad``; a module in training
mode, or inputs that require grad, run eagerly): training steps are
:func:`opsched.train_step`.  ``policy=None`` means the policy shipped with
opsched (``opsched.policies.exported.pretrained_path()``).
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.adapters.base import (
    Adapter,
    Fallback,
    FallbackReason,
    Scheduled,
    ScheduleFallbackWarning,
    merged_meta,
    outputs_equal,
)
from opsched.engine.contracts import Backend, PerfModel
from opsched.errors import OpschedError, PolicyError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine, get_machine
from opsched.measured import DEFAULT_TOP
from opsched.plan import Plan
from opsched.planning import candidates_cached, plan_cached, planning_model, resolve_policy
from opsched.policies.base import Policy

#: ``backend=`` choices of :func:`apply` besides an open backend: ``auto`` and every
#: registered backend with an adapter.
AUTO = "auto"
#: What ``backend="auto"`` runs a PyTorch module on: ``ort`` - ONNX Runtime's kernels
#: (fused, blocked layouts) run the zoo faster than PyTorch's (the benchmark report's ORT
#: column), and on ``ort`` a plan the model does not predict faster than ONNX Runtime's own
#: sequential run is replaced by it - when onnx and onnxruntime import and the module
#: exports to ONNX with outputs that match the module's, else ``torch-cpu``.
AUTO_BY_FRAMEWORK = {"torch": ("ort", "torch-cpu"), "keras": ("tf",), "onnx": ("ort",), "torch-train": ("torch-cpu",),
                     "keras-train": ("tf",)}

_BACKENDS: dict[tuple[str, str], Backend] = {}
_LOCK = threading.Lock()


def backend_choices() -> tuple[str, ...]:
    """What ``backend=`` (and ``opsched apply --backend``) accepts by name."""
    from opsched.backends.registry import names

    return (AUTO, *names(apply=True))


# ---------------------------------------------------------------- backends
def shared_backend(name: str, machine: Machine) -> Backend:
    """One backend per (runtime, machine) for every scheduled model of the process
    (one worker pool, not one per model; closed at exit)."""
    key = (name, machine.hardware_fingerprint())  # one pool whatever the load (plans are checked on hardware)
    with _LOCK:
        be = _BACKENDS.get(key)
        if be is None:
            from opsched.backends.registry import get_backend

            be = _BACKENDS[key] = get_backend(name, machine.at_rest())
            atexit.register(be.close)
        return be


def framework_of(network: Any) -> str:
    """``torch``, ``keras``, ``onnx``, or ``torch-train`` / ``keras-train`` (a training step; TypeError
    for anything else)."""
    from opsched.adapters.onnx import is_onnx_model
    from opsched.specs import is_keras

    if type(network).__name__ == "TrainingNetwork":
        return "torch-train"
    if type(network).__name__ == "KerasTrainingNetwork":
        return "keras-train"
    if is_keras(network):
        return "keras"
    if is_onnx_model(network):
        return "onnx"
    try:
        from torch import nn
    except ImportError:  # pragma: no cover - torch is a dependency
        nn = None  # type: ignore[assignment]
    if nn is not None and isinstance(network, nn.Module):
        return "torch"
    raise TypeError(f"opsched.apply: expected a torch.nn.Module, a Keras model or an ONNX model, got "
                    f"{type(network).__name__}")


def resolve_backend(choice: str, framework: str, what: str = "the model") -> tuple[str, ...]:
    """The backends ``backend=choice`` means for a network of ``framework``, in the order to try
    (``auto`` on a PyTorch module: ``ort``, then ``torch-cpu`` should the export not work)."""
    from opsched.backends.registry import BACKENDS

    choices = backend_choices()
    if choice not in choices:
        raise OpschedError(f"unknown backend {choice!r}; choose from {', '.join(choices)}")
    if choice == AUTO:
        out = tuple(b for b in AUTO_BY_FRAMEWORK[framework] if BACKENDS[b].missing() is None)
        if not out:
            raise OpschedError(f"no backend can run {what} here: {BACKENDS[AUTO_BY_FRAMEWORK[framework][0]].missing()}")
        return out
    spec = BACKENDS[choice]
    if framework not in spec.frameworks():
        fits = [n for n in choices[1:] if framework in BACKENDS[n].frameworks()]
        kind = {"torch": "a PyTorch model", "keras": "a Keras model", "onnx": "an ONNX model",
                "torch-train": "a PyTorch training step", "keras-train": "a Keras training step"}
        runs = " and ".join(dict.fromkeys(  # a Keras training step is a Keras model's: "runs Keras models"
            {"torch": "PyTorch", "keras": "Keras", "onnx": "ONNX", "torch-train": "PyTorch training step",
             "keras-train": "Keras"}[f] for f in spec.frameworks()))
        raise OpschedError(f"backend {choice} runs {runs} models, but {what} is {kind[framework]}; use "
                           f"{' or '.join(fits)} (or auto)")
    return (choice,)


# ----------------------------------------------------------------- prepare
@dataclass
class Prepared:
    """One network imported for one backend: what every policy scheduled on it shares.

    ``graph`` is None (and ``fallback`` says why) when the network cannot be
    scheduled at all; ``reference`` holds the framework's own outputs on
    ``feeds`` (computed once)."""

    network: Any
    adapter: Adapter
    backend_name: str
    machine: Machine
    perf_model: PerfModel
    graph: OpGraph | None
    feeds: tuple
    fallback: Fallback | None = None
    backend: Backend | None = None
    _reference: Any = field(default=None, repr=False)
    _has_reference: bool = field(default=False, repr=False)

    def reference(self) -> Any:
        if not self._has_reference:
            assert self.graph is not None
            self._reference = self.adapter.reference(self.graph, self.feeds)
            self._has_reference = True
        return self._reference

    def open_backend(self) -> Backend:
        if self.backend is None:
            self.backend = shared_backend(self.backend_name, self.machine)
        self.adapter.prepare_backend(self.backend, self.perf_model)
        return self.backend

    def eager(self, fallback: Fallback, policy: Policy | None = None, plan: Plan | None = None,
              warn: bool = True) -> Scheduled:
        """The network running eagerly, saying why."""
        if warn:
            warnings.warn(f"opsched.apply: {fallback}; running {self.adapter.eager_description()} eagerly",
                          ScheduleFallbackWarning, stacklevel=4)
        return self.adapter.wrap(self.graph, plan, self.machine, policy, None, fallback, self.feeds)


def prepare(network: Any, example_inputs: Any = None, *, backend: str | Backend = AUTO,
            machine: Machine | str | None = None, perf_model: PerfModel | str = "auto", batch: int = 1,
            graph: OpGraph | None = None) -> Prepared:
    """Import ``network`` for its backend and choose the planning model (steps 1-2 of the module
    docstring), once for every policy :func:`schedule` is called with.

    ``backend``: a name (:func:`backend_choices`) or an open backend (its machine is the one
    planned for).  ``graph``: the network's graph when the caller imported it already (``opsched
    apply`` takes an exported zoo model from the export cache).  Never raises for a network it
    cannot schedule: the result then carries a ``fallback``."""
    from opsched.backends.registry import spec

    framework = framework_of(network)
    open_backend: Backend | None = None
    if isinstance(backend, str):
        names = resolve_backend(backend, framework, type(network).__name__)
    else:
        open_backend, names = backend, (backend.name,)
        if framework not in spec(backend.name).frameworks():
            raise OpschedError(f"backend {backend.name} cannot schedule a {framework} network")
    if open_backend is not None:
        mach = open_backend.machine
    else:  # this machine as it is now: cores busy with other work are part of what is planned for
        mach = get_machine(machine or "local:load")
        if not spec(names[0]).cuda:
            mach = mach.cpu_only()
    last: Prepared | None = None
    for k, name in enumerate(names):
        adapter = spec(name).adapter(framework)(network, example_inputs, name, batch)
        model = planning_model(mach, name, perf_model) if isinstance(perf_model, str) else perf_model
        last = _import(adapter, name, mach, model, graph if k == 0 else None)
        last.backend = open_backend
        retry = k + 1 < len(names) and last.fallback is not None and last.fallback.reason in (
            FallbackReason.IMPORT, FallbackReason.EXPORT_DIFFERS)
        if not retry:
            return last
    assert last is not None
    return last


def _import(adapter: Adapter, name: str, machine: Machine, model: PerfModel, graph: OpGraph | None) -> Prepared:
    refuse = adapter.refuse()
    if refuse is not None:
        return Prepared(adapter.network, adapter, name, machine, model, None, adapter.inputs, refuse)
    try:
        graph = graph if graph is not None else adapter.import_graph()
    except OpschedError as exc:
        return Prepared(adapter.network, adapter, name, machine, model, None, adapter.inputs,
                        Fallback(FallbackReason.IMPORT, f"cannot import the model: {exc}"))
    feeds = adapter.feeds(graph)
    out = Prepared(adapter.network, adapter, name, machine, model, graph, feeds)
    try:
        out.fallback = adapter.check_import(graph, feeds)
    except OpschedError as exc:
        out.fallback = Fallback(FallbackReason.IMPORT, f"cannot run the imported model: {exc}")
    return out


# ---------------------------------------------------------------- schedule
def schedule(prepared: Prepared, policy: Policy | str | Path | None = None, *, plan: Plan | None = None,
             verify: bool = True, measure: int = DEFAULT_TOP, warn: bool = True,
             memory_limit: float | None = None) -> Scheduled:
    """Steps 2-6 of the module docstring for one policy (or a saved ``plan``) on a prepared network.

    ``memory_limit``: bytes of activations a plan may keep alive at once (default: the
    machine's memory; see :func:`fit_memory`).  A saved plan made for another graph or
    machine is an argument error (raised); everything else falls back."""
    pol: Policy | None = None
    if plan is None:
        try:
            pol = resolve_policy(policy)
        except PolicyError as exc:
            return prepared.eager(Fallback(FallbackReason.POLICY, f"cannot use the policy: {exc}"), warn=warn)
    graph, machine = prepared.graph, prepared.machine
    if prepared.fallback is not None or graph is None:
        if plan is not None and graph is not None:
            plan.validate(graph, machine)
        assert prepared.fallback is not None
        return prepared.eager(prepared.fallback, pol, warn=warn)
    adapter, model = prepared.adapter, prepared.perf_model
    if plan is not None:
        plan.validate(graph, machine)  # a saved plan for another graph or machine is an argument error
        chosen, plan_s, found = plan, None, None
    else:
        assert pol is not None
        t0 = time.perf_counter()
        try:
            found = candidates_cached(pol, graph, machine, model)
            chosen = plan_cached(pol, graph, machine, model)
            chosen.validate(graph, machine)
            chosen, found = adapter.choose(graph, chosen, found, machine, model, pol)
            chosen, found = fit_memory(graph, machine, model, chosen, found, memory_limit)
        except MemoryCapError as exc:
            return prepared.eager(Fallback(FallbackReason.MEMORY, str(exc)), pol, warn=warn)
        except (OpschedError, ValueError) as exc:
            return prepared.eager(Fallback(FallbackReason.PLAN, f"the policy cannot plan this graph: {exc}"), pol,
                                  warn=warn)
        plan_s = time.perf_counter() - t0
    be = prepared.open_backend()
    try:
        if found is not None and measure >= 2:
            t1 = time.perf_counter()
            chosen = _measured(be, graph, chosen, found, prepared, measure)
            plan_s = (plan_s or 0.0) + time.perf_counter() - t1  # timing the candidates is part of choosing
        why = adapter.check_run(be, graph, chosen, prepared.feeds, prepared.reference()) if verify else None
        if why is not None:
            return prepared.eager(Fallback(FallbackReason.OUTPUTS_DIFFER, why), pol, chosen, warn=warn)
    except OpschedError as exc:
        return prepared.eager(Fallback(FallbackReason.RUN_FAILED, f"the scheduled run failed: {exc}"), pol, chosen,
                              warn=warn)
    out = adapter.wrap(graph, chosen, machine, pol, be, None, prepared.feeds)
    if plan is None and measure >= 2:
        t2 = time.perf_counter()
        why = adapter.against_framework(out)
        plan_s = (plan_s or 0.0) + time.perf_counter() - t2
        if why is not None:  # the framework's own run was faster here: run it (saying so)
            eager = prepared.eager(why, pol, chosen, warn=warn)
            eager.plan_s = plan_s
            return eager
    out.plan_s = plan_s
    return out


class MemoryCapError(OpschedError):
    """No plan of the network fits the memory cap (the message gives the bytes)."""


def memory_cap(machine: Machine, memory_limit: float | None = None) -> float:
    """The cap a plan's live activations must stay under: ``memory_limit`` or the CPU's memory
    (``memory_gb``; no cap where the machine does not say)."""
    if memory_limit is not None:
        return float(memory_limit)
    gb = machine.cpu.memory_gb
    return gb * 1e9 if gb and gb > 0 else float("inf")


def fit_memory(graph: OpGraph, machine: Machine, model: PerfModel, chosen: Plan,
               found: dict[str, tuple[Plan, float]] | None, memory_limit: float | None = None
               ) -> tuple[Plan, dict[str, tuple[Plan, float]] | None]:
    """Keep the plan (and the candidates to time) within the memory cap.

    Co-running keeps more activations alive than running one op after another (a
    training step most: every forward activation lives until its backward op).  The
    simulator counts each op's output bytes from its start until its last reader ends
    (:meth:`~opsched.engine.sim.Simulator.peak_bytes`); a plan over the cap is replaced by
    the fastest candidate under it, else by the sequential plan, else
    :class:`MemoryCapError` (the network then runs eagerly, saying so)."""
    from opsched.engine.sim import Simulator

    cap = memory_cap(machine, memory_limit)
    if cap == float("inf"):
        return chosen, found
    sim = Simulator(machine, model)
    peak = sim.peak_bytes(graph, chosen)
    fits = {k: v for k, v in (found or {}).items() if sim.peak_bytes(graph, v[0]) <= cap}
    if peak <= cap:
        return chosen, (fits or None) if found is not None else None
    if fits:
        best = min(fits, key=lambda k: fits[k][1])
        return merged_meta(fits[best][0], memory_cap_bytes=cap, instead_of_peak_bytes=peak), fits
    from opsched.policies.registry import entry

    seq = entry("sequential").make().plan(graph, machine, model)
    seq_peak = sim.peak_bytes(graph, seq)
    if seq_peak <= cap:
        return merged_meta(seq, memory_cap_bytes=cap, instead_of_peak_bytes=peak), None
    raise MemoryCapError(f"no plan of {graph.name!r} keeps its activations under the memory cap of "
                         f"{_size(cap)} (the policy's plan needs {_size(peak)}, one op at a time {_size(seq_peak)})")


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


_MEASURED = IdentityLRU(64)  # per (model's choice, backend, machine, measure): the plan timing kept


def _measured(be: Backend, graph: OpGraph, chosen: Plan, found: dict[str, tuple[Plan, float]], prepared: Prepared,
              measure: int) -> Plan:
    """The fastest of the shortlist timed on ``be`` (:func:`opsched.measured.choose_measured`), kept per
    model's choice: scheduling the same network again neither re-times nor changes its plan."""
    from opsched.measured import choose_measured

    key = (graph.fingerprint(), id(chosen), prepared.machine.fingerprint(), be.name, measure)
    return _MEASURED.get_or_make(key, lambda: choose_measured(be, graph, found, prepared.feeds, top=measure,
                                                              always=prepared.adapter.always_time), chosen, be)


# -------------------------------------------------------------------- apply
def apply(policy: Policy | str | Path | None, model: Any, example_inputs: Any = None, *,
          backend: str | Backend = AUTO, machine: Machine | str | None = None,
          perf_model: PerfModel | str = "auto", plan: Plan | None = None, verify: bool = True, batch: int = 1,
          measure: int = DEFAULT_TOP, memory_limit: float | None = None) -> Scheduled:
    """Plan ``model`` with ``policy`` and return it scheduled (see the module docstring).

    ``policy``: an exported policy's folder, a Policy, a heuristic's name, or
    None for the shipped policy.  ``model``: an ``nn.Module`` (in eval mode),
    a built Keras model, or an ONNX model (a ``.onnx`` path, its bytes or a
    ``ModelProto``).  ``example_inputs``: a tensor or a tuple of them
    (numpy arrays for Keras and ONNX; default: the importer's random inputs),
    with the shapes later calls will use.  ``backend``: ``auto`` (the model's
    framework's runtime: ``ort`` for a PyTorch module that exports, else
    ``torch-cpu``; ``tf`` for Keras; ``ort`` for ONNX), a registered backend's
    name (``torch-cpu``, ``torch-cuda``, ``tf``, ``ort``), or an open backend
    to run on.  ``machine``: this machine by default (probed; the runtime
    executes here).  ``perf_model``: ``auto``, ``analytic``, ``fitted`` or a
    performance model object.  ``plan``: run this saved Plan instead of
    planning.  ``verify``: run the Plan once on the example inputs and compare
    with the reference.  ``batch``: the batch size a Keras or ONNX model is
    planned for when no example inputs are given.  ``measure``: how many of a
    policy's best candidate plans (by the planning model) are timed on the
    runtime, on the example inputs, the fastest kept (:mod:`opsched.measured`;
    ``plan.meta["measured"]``); 0 or 1 trusts the model alone.  ``memory_limit``:
    bytes of activations a plan may keep alive at once (default: the machine's
    memory; :func:`fit_memory`).

    Never raises for a model it cannot schedule: the result then runs eagerly
    and a :class:`ScheduleFallbackWarning` says why (errors in the arguments
    themselves -- not a model, an unknown machine or backend, a saved ``plan``
    made for another graph or machine, a policy file that does not load --
    still raise)."""
    if plan is None and not isinstance(policy, Policy):
        try:  # before the import: a broken policy file is found in milliseconds, not after an export
            policy = resolve_policy(policy)
        except PolicyError as exc:
            framework = framework_of(model)
            return _unprepared(model, example_inputs, framework, backend, machine, batch).eager(
                Fallback(FallbackReason.POLICY, f"cannot use the policy: {exc}"))
    prepared = prepare(model, example_inputs, backend=backend, machine=machine, perf_model=perf_model, batch=batch)
    return schedule(prepared, policy, plan=plan, verify=verify, measure=measure, memory_limit=memory_limit)


def _unprepared(network: Any, example_inputs: Any, framework: str, backend: str | Backend,
                machine: Machine | str | None, batch: int) -> Prepared:
    """A Prepared that imported nothing (for a fallback decided before the import)."""
    from opsched.backends.registry import spec
    from opsched.engine.sim import default_perf_model

    name = resolve_backend(backend, framework)[0] if isinstance(backend, str) else backend.name
    mach = backend.machine if not isinstance(backend, str) else get_machine(machine or "local").cpu_only()
    adapter = spec(name).adapter(framework)(network, example_inputs, name, batch)
    return Prepared(network, adapter, name, mach, default_perf_model(), None, adapter.inputs)


def __getattr__(name: str) -> Any:
    """The scheduled-model classes live with their adapters; reachable here too."""
    if name == "ScheduledModule":
        from opsched.adapters.torch import ScheduledModule

        return ScheduledModule
    if name in ("ScheduledKeras", "keras_eager", "TF_RTOL", "TF_ATOL"):
        from opsched.adapters import keras

        return getattr(keras, name)
    if name == "ScheduledOnnx":
        from opsched.adapters.onnx import ScheduledOnnx

        return ScheduledOnnx
    if name in ("RTOL", "ATOL"):
        from opsched.adapters import torch as torch_adapter

        return getattr(torch_adapter, name)
    raise AttributeError(f"module 'opsched.scheduled' has no attribute {name!r}")


__all__ = ["AUTO", "Fallback", "FallbackReason", "Prepared", "ScheduleFallbackWarning", "Scheduled", "apply",
           "backend_choices", "framework_of", "outputs_equal", "prepare", "resolve_backend", "schedule",
           "shared_backend"]
