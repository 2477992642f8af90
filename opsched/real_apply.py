"""What ``opsched apply`` measures: a policy's schedule of a model against the
framework's own execution and critical-path-first, on this machine, for real.

:func:`run_apply` loads the model spec, schedules it twice with
:func:`opsched.apply` (the policy and critical-path-first; each checked once
against eager execution), and times every configuration with
:func:`opsched.timing.interleave` (warm-up, interleaved rounds, medians, the
load they ran under).  References: eager PyTorch for a torch model;
TensorFlow's own settings (``tf-default``) and the recommended ones
(``tf-recommended``) for a Keras model; on the ``ort`` backend, ONNX
Runtime's sequential execution at its default threads (``ort-sequential``,
the row speed-ups are relative to) and, for a torch model, eager PyTorch.  The result is plain JSON-ready data;
the command only formats it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from opsched.errors import OpschedError
from opsched.timing import interleave, wall_clock

#: A configuration to time (one call, returning its seconds) and its plan in words.
Config = tuple[Callable[[], float], str]


def plan_summary(plan: Any) -> str:
    """Threads used and how many ops wait for another, in a few words."""
    if plan is None:
        return "-"
    threads = sorted({a.threads for a in plan.assignments.values()})
    waits = sum(1 for a in plan.assignments.values() if a.after)
    return f"threads {'/'.join(map(str, threads))}" + (f", {waits} holds" if waits else "")


def _ort_references(loaded: Any, fast: Any) -> tuple[dict[str, Config], dict[str, bool]]:
    """ONNX Runtime's sequential session at its default threads (the exported
    model for a torch model) and eager PyTorch for a torch model; outputs
    checked against the scheduled run's reference like a plan's."""
    from opsched.backends.ort_apply import EXPORT_ATOL, EXPORT_RTOL, reference_session, run_reference
    from opsched.scheduled import outputs_equal

    graph = fast.graph
    sess = reference_session(graph)
    feeds = dict(zip(graph.source.inputs, graph.source.check_inputs(fast.example_inputs), strict=True))
    names = list(graph.source.outputs)
    seq = run_reference(sess, graph, fast.example_inputs)
    configs: dict[str, Config] = {"ort-sequential": (wall_clock(lambda: sess.run(names, feeds)),
                                                     "ONNX Runtime sequential, default threads")}
    same = {"ort-sequential": True}
    if loaded.framework == "torch":
        import torch

        module, inputs = loaded.model, loaded.inputs

        def eager() -> float:
            with torch.no_grad():
                return wall_clock(lambda: module(*inputs))()

        configs["eager"] = (eager, f"torch default ({torch.get_num_threads()} threads)")
        with torch.no_grad():
            want = [x.detach().numpy() for x in torch.utils._pytree.tree_leaves(module(*inputs))]
        same["eager"] = same["ort-sequential"] = outputs_equal(seq, want, EXPORT_RTOL, EXPORT_ATOL)
    return configs, same


def _references(loaded: Any, fast: Any, machine: Any, be: Any) -> tuple[dict[str, Config], dict[str, bool]]:
    """The framework's own execution: eager PyTorch, or TensorFlow at its default
    and recommended thread settings (whose outputs are checked like a plan's)."""
    if getattr(be, "name", "") == "ort":
        return _ort_references(loaded, fast)
    if loaded.framework == "torch":
        import torch

        module, inputs = loaded.model, loaded.inputs

        def eager() -> float:
            with torch.no_grad():
                return wall_clock(lambda: module(*inputs))()

        return {"eager": (eager, f"torch default ({torch.get_num_threads()} threads)")}, {"eager": True}
    from opsched.backends.tf_cpu import tf_default, tf_recommended
    from opsched.scheduled import TF_ATOL, TF_RTOL, keras_eager, outputs_equal

    graph, feeds = fast.graph, list(fast.example_inputs)
    want = keras_eager(loaded.model, feeds)
    configs, same = {}, {}
    for name, st in (("tf-default", tf_default()), ("tf-recommended", tf_recommended(machine))):
        desc = f"{'TF picks: ' if st.inter == st.intra == 0 else ''}inter={st.inter}, intra={st.intra}"
        configs[name] = (lambda st=st: be.measure(graph, st, repeats=1, warmup=0, inputs=feeds)[0], desc)
        same[name] = outputs_equal(be.execute_settings(graph, st, feeds), want, TF_RTOL, TF_ATOL)
    return configs, same


def run_apply(model_spec: str, policy: str | None = None, *, backend: str = "auto", batch: int = 1,
              width: float = 1.0, repeats: int = 10, warmup: int = 2, plan_file: Path | None = None,
              save_plan: Path | None = None, perf_model: str = "auto",
              on_call: Callable[[int, int], None] | None = None, runtime: Any = None,
              measure: int | None = None) -> dict[str, Any]:
    """Everything ``opsched apply`` does, returning the figures (see the module docstring).

    ``runtime``: an open backend to reuse (its machine is the one planned for);
    by default the process's shared backend for this machine's CPU.
    ``measure``: candidate plans of a learned policy timed before choosing
    (``opsched.apply``'s ``measure``; None: its default)."""
    import warnings

    from opsched.plan import Plan
    from opsched.planning import describe, planning_model
    from opsched.scheduled import ScheduleFallbackWarning, apply, resolve_backend, shared_backend
    from opsched.specs import load_machine, load_model

    if batch < 1 or width <= 0 or repeats < 1 or warmup < 0:
        raise OpschedError("apply: --batch and --repeats must be >= 1, --width > 0, --warmup >= 0")
    loaded = load_model(model_spec, batch, width)
    name = resolve_backend(backend, loaded.framework, repr(model_spec))
    machine = (runtime.machine if runtime is not None else load_machine("local")).cpu_only()
    if name == "ort":  # import once, from the export cache for a torch spec (apply then reuses the graph)
        from opsched.backends.ort_apply import remember
        from opsched.specs import onnx_graph_of

        try:
            remember(loaded.model, loaded.inputs, onnx_graph_of(loaded, width), loaded.batch)
        except OpschedError:
            if backend != "auto" or loaded.framework != "torch":
                raise
            name = "torch-cpu"  # auto: the export does not work; the PyTorch runtime schedules the module
    model = planning_model(machine, name, perf_model)
    saved = Plan.load(plan_file) if plan_file is not None else None

    fallbacks: dict[str, str] = {}
    scheduled = {}
    for key, pol, plan in (("critical-path-first", "critical-path-first", None), ("policy", policy, saved)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ScheduleFallbackWarning)
            extra = {} if measure is None else {"measure": measure}
            sm = apply(pol, loaded.model, loaded.inputs, backend=name, machine=machine, perf_model=model,
                       plan=plan, runtime=runtime, batch=loaded.batch, **extra)
        if not sm.scheduled:
            fallbacks[key] = sm.fallback_reason or "; ".join(str(w.message) for w in caught)
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
    if fast.graph is None:
        raise OpschedError(f"apply: {fallbacks.get('policy', 'the model cannot be scheduled')}")

    be = runtime if runtime is not None else shared_backend(name, machine)
    configs, same = _references(loaded, fast, machine, be)
    inputs = loaded.inputs if loaded.framework == "torch" else fast.example_inputs
    if name == "ort":
        inputs = fast.example_inputs
    for key, sm in (("critical-path-first", scheduled["critical-path-first"]), (label, fast)):
        configs[key] = (lambda sm=sm: sm.time_call(*inputs), plan_summary(sm.plan) if sm.scheduled
                        else f"eager (fallback: {sm.fallback_reason})")
        # opsched.apply checked the scheduled outputs against eager; a mismatch made it fall back
        same[key] = "differ from" not in (sm.fallback_reason or "")
    if name == "ort":  # ONNX Runtime's intra-op threads spin for a while after a run: time each call as alone
        from opsched.backends.ort_apply import after_gap

        configs = {k: (after_gap(fn), desc) for k, (fn, desc) in configs.items()}
    worker_pids = getattr(be, "worker_pids", None)
    timings = interleave({k: c[0] for k, c in configs.items()}, warmup, repeats,
                         pids=worker_pids() if callable(worker_pids) else (), on_call=on_call)

    reference = next(iter(configs))
    rows = []
    for key in configs:
        st = timings.stats(key)
        rows.append({"config": key, "median_s": st["median"], "q1_s": st["q1"], "q3_s": st["q3"],
                     "min_s": st["min"], "max_s": st["max"], "speedup": timings.median(reference) / st["median"],
                     "outputs_equal_eager": bool(same[key]), "plan": configs[key][1]})
    return {
        "model": model_spec, "framework": loaded.framework, "backend": name, "reference": reference,
        "batch": batch, "width": width, "graph": fast.graph.name, "n_ops": len(fast.graph.ops),
        "machine": machine.name, "cores": machine.cpu.cores, "perf_model": describe(model), "policy": policy_desc,
        "plan_s": fast.plan_s, "chosen": fast.plan.meta.get("chosen") if fast.plan else None,
        "measured": fast.plan.meta.get("measured") if fast.plan else None, "coarsened": bool(fast.plan.meta.get("coarsened", False)) if fast.plan else False,
        "repeats": repeats, "warmup": warmup, "rows": rows, "fallbacks": fallbacks, "load": timings.load_record(),
        "load_warning": timings.warning(),
        "policy_vs_cpf": timings.median("critical-path-first") / timings.median(label),
    }


__all__ = ["plan_summary", "run_apply"]
