"""What ``opsched apply`` measures: a policy's schedule of a network against the
framework's own execution and critical-path-first, on this machine, for real.

:func:`run_apply` resolves the policy (a broken policy file fails here, before
any import), loads the model spec, imports it once for its backend
(:func:`opsched.scheduled.prepare`), schedules it with critical-path-first and
with the policy (:func:`opsched.scheduled.schedule`, each planned once and
checked once against the reference), and times every configuration with
:func:`opsched.timing.interleave`: warm-up, interleaved rounds, each timed
call only after the previous one's threads went quiet
(:func:`opsched.timing.settle`: ONNX Runtime's and OpenMP's spinning threads,
measured), medians, the load they ran under.  The configurations are the
adapter's own (eager PyTorch; TensorFlow's default and recommended settings;
ONNX Runtime's sequential session, and eager PyTorch for an exported module),
then critical-path-first and the policy.  Speed-ups are relative to the first
row; a speed-up is *real* only when the per-round ratios say so
(:attr:`ConfigResult.verdict`: ``faster`` when the time ratio's upper
quartile is below :data:`SAME_BAND` below 1, ``slower`` symmetric, ``same``
otherwise).  The result is an :class:`ApplyResult`; the command only formats it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opsched.adapters.base import Config, FallbackReason, ScheduleFallbackWarning, describe_plan
from opsched.errors import OpschedError
from opsched.timing import interleave

#: Per-round time ratios within this band of 1 (at the quartiles) are "the same speed".
SAME_BAND = 0.02


@dataclass(frozen=True)
class ConfigResult:
    """One timed configuration of ``opsched apply``."""

    config: str
    plan: str
    median_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    #: the reference row's median over this row's (> 1: this row is faster)
    speedup: float
    #: quartiles of this row's time over the reference row's, round by round
    ratio_q1: float
    ratio_q3: float
    #: ``faster`` / ``slower`` / ``same`` than the reference, by the per-round ratios (see SAME_BAND)
    verdict: str
    outputs_equal_eager: bool
    #: median seconds :func:`opsched.timing.settle` waited for the previous call's threads before each call
    settle_s: float


@dataclass(frozen=True)
class ApplyResult:
    """Everything ``opsched apply`` measured (``apply.json`` is :meth:`to_dict`)."""

    model: str
    framework: str
    backend: str
    mode: str
    reference: str
    batch: int
    width: float
    graph: str
    n_ops: int
    machine: str
    cores: int
    perf_model: str
    policy: str
    plan_s: float | None
    chosen: str | None
    measured: dict[str, float] | None
    coarsened: bool
    repeats: int
    warmup: int
    rows: list[ConfigResult]
    fallbacks: dict[str, str]
    load: dict[str, Any]
    load_warning: str | None
    policy_vs_cpf: float
    policy_row: str
    note: str | None = None
    fallback_reasons: dict[str, str] = field(default_factory=dict)

    def row(self, config: str) -> ConfigResult:
        for r in self.rows:
            if r.config == config:
                return r
        raise KeyError(config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _verdict(q1: float, q3: float) -> str:
    if q3 < 1.0 - SAME_BAND:
        return "faster"
    if q1 > 1.0 + SAME_BAND:
        return "slower"
    return "same"


def run_apply(model_spec: str, policy: str | None = None, *, backend: str = "auto", batch: int = 1,
              width: float = 1.0, repeats: int = 10, warmup: int = 2, plan_file: Path | None = None,
              save_plan: Path | None = None, perf_model: str = "auto",
              on_call: Callable[[int, int], None] | None = None, runtime: Any = None,
              measure: int | None = None, mode: str = "infer", optimizer: str = "sgd",
              lr: float | None = None, memory_limit: float | None = None) -> ApplyResult:
    """Everything ``opsched apply`` does, returning the figures (see the module docstring).

    ``runtime``: an open backend to reuse (its machine is the one planned for);
    by default the process's shared backend for this machine's CPU.
    ``measure``: candidate plans of a learned policy timed before choosing
    (``opsched.apply``'s ``measure``; None: its default).  ``mode``: ``infer``
    (the network's inference) or ``train`` (its training step with
    ``optimizer`` at ``lr``, :func:`opsched.training.load_training`; the rows
    are eager steps at torch's default threads and at one thread - for a
    Keras model TensorFlow's default and recommended settings - then the
    scheduled steps, each on its own copy of the model's state)."""
    from opsched.measured import DEFAULT_TOP
    from opsched.plan import Plan
    from opsched.planning import describe, resolve_policy
    from opsched.scheduled import AUTO, framework_of, prepare, resolve_backend, schedule
    from opsched.specs import load_model, onnx_graph_of

    if batch < 1 or width <= 0 or repeats < 1 or warmup < 0:
        raise OpschedError("apply: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    if mode not in ("infer", "train"):
        raise OpschedError(f"apply: --mode must be infer or train, got {mode!r}")
    saved = Plan.load(plan_file) if plan_file is not None else None
    pol = resolve_policy(policy) if saved is None else None  # a broken policy file: an error now, not after an import
    graph = None
    if mode == "train":
        from opsched.specs import load_training

        net, x, y = load_training(model_spec, batch, width, optimizer=optimizer, lr=lr)
        first = x[0] if isinstance(x, (tuple, list)) else x
        network, inputs, framework = net, (x, y), framework_of(net)  # torch-train or keras-train
        net_batch = batch = int(first.shape[0]) if getattr(first, "ndim", 0) else batch
    else:
        loaded = load_model(model_spec, batch, width)
        network, inputs, framework, net_batch = loaded.model, loaded.inputs, loaded.framework, loaded.batch
        names = resolve_backend(backend, framework_of(network), repr(model_spec)) if runtime is None \
            else (runtime.name,)
        if names[0] == "ort" and loaded.framework == "torch":  # the export cache, keyed by the spec
            try:
                graph = onnx_graph_of(loaded, width)
            except OpschedError:
                if backend != AUTO:
                    raise
    prepared = prepare(network, inputs, backend=runtime if runtime is not None else backend,
                       perf_model=perf_model, batch=net_batch, graph=graph)
    if prepared.graph is None:
        raise OpschedError(f"apply: {prepared.fallback}")
    top = DEFAULT_TOP if measure is None else measure
    fallbacks: dict[str, str] = {}
    reasons: dict[str, str] = {}
    scheduled = {}
    for key, p, plan in (("critical-path-first", "critical-path-first", None), ("policy", pol, saved)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ScheduleFallbackWarning)
            sm = schedule(prepared, p, plan=plan, measure=top if key == "policy" else 0, memory_limit=memory_limit)
        if sm.fallback is not None:
            fallbacks[key] = sm.fallback.detail or "; ".join(str(w.message) for w in caught)
            reasons[key] = sm.fallback.reason.value
        scheduled[key] = sm
    fast = scheduled["policy"]
    if saved is not None:
        label = f"saved plan ({saved.policy or 'unnamed'})"
        policy_desc = str(plan_file)
    else:
        label = f"policy ({fast.policy.name if fast.policy is not None else policy or 'pretrained'})"
        policy_desc = str(getattr(fast.policy, "folder", getattr(fast.policy, "name", policy)))
    if save_plan is not None and fast.plan is not None:
        fast.plan.save(save_plan)

    graph = prepared.graph
    be = prepared.open_backend()
    adapter = prepared.adapter
    configs: dict[str, Config] = dict(adapter.configs(graph, prepared.feeds, be, prepared.machine))
    for key, sm in (("critical-path-first", scheduled["critical-path-first"]), (label, fast)):
        # the pipeline checked the scheduled outputs once against the reference; a mismatch made it fall back
        same = sm.fallback is None or sm.fallback.reason is not FallbackReason.OUTPUTS_DIFFER
        configs[key] = Config(adapter.timer(sm, prepared.feeds),
                              describe_plan(sm.plan) if sm.scheduled else f"eager (fallback: {sm.fallback_reason})",
                              same)
    from opsched.engine.contracts import WorkerProcesses

    timings = interleave({k: c.timer for k, c in configs.items()}, warmup, repeats,
                         pids=be.worker_pids() if isinstance(be, WorkerProcesses) else (), on_call=on_call)

    import statistics

    reference = next(iter(configs))
    ratios = timings.ratios(reference)
    rows = []
    for key, cfg in configs.items():
        st, rt = timings.stats(key), ratios[key]
        rows.append(ConfigResult(
            config=key, plan=cfg.description, median_s=st["median"], q1_s=st["q1"], q3_s=st["q3"], min_s=st["min"],
            max_s=st["max"], speedup=timings.median(reference) / st["median"], ratio_q1=rt["q1"], ratio_q3=rt["q3"],
            verdict="reference" if key == reference else _verdict(rt["q1"], rt["q3"]),
            outputs_equal_eager=bool(cfg.outputs_equal),
            settle_s=float(statistics.median(timings.settle_s.get(key, [0.0])))))
    meta = fast.plan.meta if fast.plan is not None else {}
    return ApplyResult(
        model=model_spec, framework=framework, backend=prepared.backend_name, reference=reference, mode=mode,
        batch=batch, width=width, graph=graph.name, n_ops=len(graph.ops), machine=prepared.machine.name,
        cores=prepared.machine.cpu.cores, perf_model=describe(prepared.perf_model), policy=policy_desc,
        plan_s=fast.plan_s, chosen=meta.get("chosen"), measured=meta.get("measured"),
        coarsened=bool(meta.get("coarsened", False)), repeats=repeats, warmup=warmup, rows=rows,
        fallbacks=fallbacks, load=timings.load_record(), load_warning=timings.warning(),
        policy_vs_cpf=timings.median("critical-path-first") / timings.median(label), policy_row=label,
        note=adapter.note(), fallback_reasons=reasons)


def plan_summary(plan: Any) -> str:
    """Threads used and how many ops wait for another, in a few words."""
    return describe_plan(plan)


__all__ = ["SAME_BAND", "ApplyResult", "ConfigResult", "plan_summary", "run_apply"]
