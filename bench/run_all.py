"""Every opsched benchmark in one command: against what users would pick instead, and the physical limit.

    python bench/run_all.py            # full run (<= 30 min on a 2-core machine)
    python bench/run_all.py --quick    # smoke run (<= 5 min): fewer models, batch 1, few repeats
    opsched bench [--quick]            # the same, through the CLI

Writes ``runs/bench_<N>/``: ``report.md`` (the headline table first, with the
command and machine that produced it), ``results.json`` (every raw figure),
PNG figures, ``command.txt``, ``machine.json`` and ``versions.json``, and
under ``sub/`` the outputs of the per-topic scripts it calls, the plans and
the worker logs; ``errors.log`` holds the tracebacks behind any "skipped".
ONNX exports are cached in ``runs/onnx_cache/``.  opsched's plans for this
machine use the performance model fitted from cached profiles
(``runs/profiles/``) when there are any -- ``--profile`` first profiles the
zoo models that have none (minutes per model, outside the 30-minute budget).
``python bench/_report.py runs/bench_<N>`` re-renders a saved run's report.

Sections (``--sections``; each one whose dependency does not import or fails
is reported as ``skipped: <reason>``, never faked):

1. ``real`` -- every zoo model at batch 1 and 8 on this machine: time per
   inference as a ratio to eager PyTorch with its default threads, for eager
   at 1 thread, ``torch.compile``, ONNX Runtime (sequential and parallel
   execution modes), and opsched's heuristics and learned policy on its torch
   runtime.  Each configuration runs in its own process; rounds interleave
   them after a warm-up; each ratio is taken inside a round and the median
   and quartiles over rounds are reported.  Outputs are checked against
   eager's.  ``keras``: TensorFlow's default / recommended / opsched's thread
   settings for Keras application models (``bench/keras_settings.py``).
2. ``sim`` -- every preset machine x the training config's held-out graphs in
   the simulator: the learned policy, every heuristic and Optuna search with a
   fixed trial budget; makespan / lower bound, speedup over sequential, time to
   decide.
3. ``costs`` -- runtime overhead per op, simulator ops/s, environment steps/s
   (``bench/runtime_overhead.py``, ``sim_speed.py``, ``env_speed.py``), planning
   time by graph size, and the time the newest ``train-policy`` run took to beat
   critical-path-first on its held-out set.
4. ``fidelity`` -- simulated against measured makespans on this machine for
   many plans per zoo model: error, Spearman rank correlation, scatter plot.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
from _report import write_figures, write_report  # noqa: E402

SECTIONS = ("real", "keras", "sim", "costs", "fidelity")
REAL_POLICIES = ("sequential", "tf-default", "tf-recommended", "critical-path-first", "heft", "maestro")
QUICK_MODELS = ("transformer", "lstm")
#: Calls per configuration per round: as many as fit in this many seconds, at most --iters.
ITER_TARGET_S = 0.25


# ======================================================================= setup
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/run_all.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer models, batch 1, few repeats")
    ap.add_argument("--out", default="runs", help="folder that receives bench_<N>/ (default: runs)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--models", default="", help="zoo models for sections 1 and 4 (default: all; quick: "
                    + ",".join(QUICK_MODELS) + ")")
    ap.add_argument("--batches", default="", help="batch sizes for section 1 (default 1,8; quick: 1)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved timing rounds (default 7; quick 3)")
    ap.add_argument("--iters", type=int, default=0, help="calls per configuration per round (default 3; quick 2)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed calls per configuration (default 3; quick 2)")
    ap.add_argument("--policy", default="", help="exported learned policy folder (default: policies/pretrained/ "
                    "or the newest runs/*/policy/; 'none' to leave it out)")
    ap.add_argument("--search-trials", type=int, default=0, help="Optuna search budget per graph (default 100; quick 20)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out of section 1")
    ap.add_argument("--init-timeout", type=float, default=0, help="seconds a configuration may take to prepare "
                    "(compile, export) before it is skipped (default 300; quick 150)")
    ap.add_argument("--fidelity-plans", type=int, default=0, help="plans per model in section 4 (default 24; quick 10)")
    ap.add_argument("--profile", action="store_true", help="profile zoo models without a cached profile first "
                    "(so opsched plans and the simulator use the fitted performance model)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    args.rounds = args.rounds or (3 if q else 7)
    args.iters = args.iters or (2 if q else 3)
    args.warmup = args.warmup or (2 if q else 3)
    args.search_trials = args.search_trials or (10 if q else 100)
    args.init_timeout = args.init_timeout or (150.0 if q else 300.0)
    args.fidelity_plans = args.fidelity_plans or (10 if q else 24)
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()] if args.batches else ([1] if q else [1, 8])
    return args


def zoo_models(args: argparse.Namespace) -> list[str]:
    from opsched.zoo import ZOO

    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in names if m not in ZOO]
        if unknown:
            raise SystemExit(f"bench/run_all.py: unknown zoo model(s) {', '.join(unknown)}; zoo: {', '.join(ZOO)}")
        return names
    return list(QUICK_MODELS) if args.quick else list(ZOO)


def find_learned_policy(spec: str) -> tuple[Any, str]:
    """``(policy or None, where it came from or why there is none)``."""
    if spec == "none":
        return None, "left out (--policy none)"
    if spec:
        candidates = [Path(spec)]
    else:
        candidates = [H.REPO / "policies" / "pretrained"]
        runs = sorted((H.REPO / "runs").glob("*/policy/policy.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        candidates += [p.parent for p in runs]
    reasons = []
    for c in candidates:
        if not (c / "policy.json").is_file():
            reasons.append(f"{c}: no policy.json")
            continue
        try:
            from opsched.policies import load

            pol = load(c)
            return pol, str(c)
        except Exception as exc:
            reasons.append(f"{c}: {type(exc).__name__}: {exc}")
    return None, ("no exported learned policy (looked in policies/pretrained/ and runs/*/policy/)"
                  if not spec else "; ".join(reasons))


def perf_model(machine: Any) -> tuple[Any, str]:
    """The fitted model from cached profiles of this machine, else the analytic one."""
    try:
        from opsched.backends.fitted import fitted_or_analytic

        model = fitted_or_analytic(machine)
    except Exception as exc:
        from opsched.backends.perfmodel import default_model

        return default_model(), f"analytic (fitted model unavailable: {type(exc).__name__}: {exc})"
    kind = type(model).__name__
    return model, ("fitted from cached profiles (runs/profiles/)" if kind == "FittedModel" else
                   "analytic (no cached profile of this machine; run `opsched profile` or pass --profile)")


def _quiet() -> contextlib.AbstractContextManager:
    """Silence library chatter (exporter warnings, prints) in the driver."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    return stack


# ======================================================================= section 1: real execution
def export_onnx(module: Any, inputs: tuple, path: Path) -> str | None:
    """Export with the TorchScript-based exporter (``dynamo=False``: the
    dynamo exporter needs onnxscript); ``None`` when it worked, else why not."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install onnx onnxruntime)"
    import torch

    if path.is_file():
        return None
    tmp = path.with_suffix(".tmp.onnx")
    try:
        with _quiet(), torch.no_grad():
            torch.onnx.export(module, inputs, str(tmp), dynamo=False)
        os.replace(tmp, path)
        return None
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        return f"torch.onnx.export failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def onnx_cache_key(model: str, batch: int) -> str:
    import hashlib

    import torch

    from opsched.zoo import ZOO

    src = (H.REPO / "opsched" / "zoo" / f"{ZOO[model].module}.py")
    h = hashlib.sha256(f"{torch.__version__}|{model}|{batch}".encode())
    for f in (src, H.REPO / "opsched" / "zoo" / "_layers.py"):
        if f.is_file():
            h.update(f.read_bytes())
    return f"{model}_b{batch}_{h.hexdigest()[:12]}.onnx"


def make_plans(graph: Any, machine: Any, model: Any, learned: Any) -> tuple[dict[str, Any], dict[str, float],
                                                                          dict[str, str], dict[str, str]]:
    """Every opsched policy's plan for ``graph``: (plans, decision seconds,
    {policy: identical earlier policy}, {policy: failure})."""
    from opsched.policies import get_policy, timed_plan

    plans, decide, same, failed = {}, {}, {}, {}
    pols: list[tuple[str, Any]] = []
    for name in REAL_POLICIES:
        try:
            pols.append((name, get_policy(name)))
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    if learned is not None:
        pols.append(("learned", learned))
    for name, pol in pols:
        try:
            plan, dt = timed_plan(pol, graph, machine, model)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        decide[name] = dt
        twin = next((k for k, p in plans.items() if p.assignments == plan.assignments), None)
        if twin is not None:
            same[name] = twin
        else:
            plans[name] = plan
    return plans, decide, same, failed


def compare_outputs(check_dir: Path, ref_label: str = "eager") -> dict[str, str]:
    """Each configuration's first output against eager's: 'ok (max rel err …)' or what differs."""
    import numpy as np

    ref_file = check_dir / f"{ref_label}.npz"
    if not ref_file.is_file():
        return {}
    with np.load(ref_file, allow_pickle=False) as z:
        ref = z[z.files[0]]
    scale = float(np.abs(ref).max()) or 1.0
    out = {}
    for f in sorted(check_dir.glob("*.npz")):
        with np.load(f, allow_pickle=False) as z:
            for key in z.files:
                label = f.stem if f.stem != "opsched" else f"opsched:{key}"
                a = z[key]
                if a.shape != ref.shape:
                    out[label] = f"shape {a.shape} != eager {ref.shape}"
                    continue
                err = float(np.abs(a - ref).max()) / scale
                out[label] = f"{'ok' if err <= 1e-3 else 'DIFFERS'} (max rel. err {err:.1e})"
    return out


def real_group(model_name: str, batch: int, args: argparse.Namespace, ctx: dict[str, Any], work: Path,
               step: Callable[[str], None]) -> dict[str, Any]:
    """Section 1 for one (model, batch): prepare, start the workers, time them interleaved."""
    from opsched.importers.torch_fx import from_torch
    from opsched.specs import load_torch_model

    res: dict[str, Any] = {"model": model_name, "batch": batch, "skipped": {}}
    gdir = work / f"{model_name}_b{batch}"
    (gdir / "plans").mkdir(parents=True, exist_ok=True)
    (gdir / "check").mkdir(exist_ok=True)
    step("import")
    module, inputs = load_torch_model(f"zoo:{model_name}", batch)
    with _quiet():
        graph = from_torch(module, inputs, name=model_name)
    res["ops"] = len(graph.ops)
    res["width"] = graph.width()
    res["gflops"] = graph.total_flops / 1e9 if hasattr(graph, "total_flops") else None

    step("plan")
    plans, decide, same, failed = make_plans(graph, ctx["machine"], ctx["model"], ctx["learned"])
    res["decision_s"], res["identical_plans"] = decide, same
    for name, why in failed.items():
        res["skipped"][f"opsched:{name}"] = why
    for name, plan in plans.items():
        plan.save(gdir / "plans" / f"{name}.json")

    onnx_path = ctx["onnx_dir"] / onnx_cache_key(model_name, batch)
    step("onnx export")
    onnx_err = export_onnx(module, inputs, onnx_path)
    del module
    common = ["--model", model_name, "--batch", str(batch)]
    specs: list[tuple[str, list[str]]] = [("eager", []), ("eager-1t", [])]
    if args.no_compile:
        res["skipped"]["compile"] = "left out (--no-compile)"
    else:
        specs.append(("compile", []))
    if onnx_err:
        res["skipped"]["ort-seq"] = res["skipped"]["ort-par"] = onnx_err
    else:
        specs += [("ort-seq", ["--onnx", str(onnx_path)]), ("ort-par", ["--onnx", str(onnx_path)])]
    if plans:
        specs.append(("opsched", ["--plans", str(gdir / "plans"), "--machine", str(ctx["machine_file"])]))
    workers = [H.Worker(kind, ["--kind", kind, *common, *extra, "--check", str(gdir / "check" / f"{kind}.npz")],
                        gdir / f"{kind}.log", env=ctx["env"]) for kind, extra in specs]
    step("start workers")
    try:
        fails = H.start_all(workers, args.init_timeout)
        for name, why in fails.items():
            if name == "opsched":
                for p in plans:
                    res["skipped"][f"opsched:{p}"] = why
            else:
                res["skipped"][name] = why
        live = [w for w in workers if w.name not in fails]
        if not any(w.name == "eager" for w in live):
            raise RuntimeError(f"the eager reference did not start: {fails.get('eager')}")
        res["workers"] = {w.name: {k: v for k, v in w.info.items() if k != "ready"} for w in live}
        res["outputs"] = compare_outputs(gdir / "check")
        configs = []
        for w in live:
            for c in w.info.get("configs", []):
                configs.append((f"opsched:{c}" if w.name == "opsched" else w.name, w, c))
        samples, tfail = H.interleave(configs, args.rounds, args.iters, args.warmup,
                                      timeout=max(120.0, args.init_timeout), on_step=lambda lab: step(lab),
                                      target_s=ITER_TARGET_S)
        res["skipped"].update(tfail)
    finally:
        for w in workers:
            w.close()
    res["round_medians_s"] = samples
    res["time_s"] = {k: H.stats(v) for k, v in samples.items()}
    res["ratio"] = H.round_ratios(samples, "eager")
    return res


def opsched_label(ctx: dict[str, Any]) -> str:
    return "learned" if ctx.get("learned") is not None else "critical-path-first"


def section_real(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    models = zoo_models(args)
    groups = [(m, b) for m in models for b in args.batches]
    # per group: 4 setup steps, then warm-up + rounds over ~11 configurations
    per_group = 4 + (args.rounds + 1) * (5 + len(REAL_POLICIES) + 1)
    task = bar.add_task("1 real execution", total=len(groups) * per_group, detail="")
    rows, skipped_groups = [], {}
    work = out / "sub" / "real"
    for k, (m, b) in enumerate(groups):
        def step(what: str, m: str = m, b: int = b) -> None:
            bar.update(task, advance=1, detail=f"{m} b{b}: {what}")

        try:
            rows.append(real_group(m, b, args, ctx, work, step))
        except Exception as exc:
            skipped_groups[f"{m} b{b}"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=ctx["log"])
        bar.update(task, completed=(k + 1) * per_group)
    return {"models": models, "batches": args.batches, "rounds": args.rounds, "iters": args.iters,
            "warmup": args.warmup, "opsched_column": opsched_label(ctx), "groups": rows,
            "skipped_groups": skipped_groups,
            "method": "each configuration in its own process; warm-up, then interleaved rounds (each starting "
                      "one configuration further along); per round the median of the calls; ratio = config / "
                      "eager within a round; median (quartiles) over rounds"}


def section_keras(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    task = bar.add_task("1b TensorFlow (Keras)", total=1, detail="bench/keras_settings.py")
    try:
        import tensorflow  # noqa: F401
    except ImportError as exc:
        bar.update(task, advance=1)
        return {"skipped": f"TensorFlow does not import: {exc}"}
    sub = out / "sub"
    argv = ["bench/keras_settings.py", "--out", str(sub)]
    if args.quick:
        argv += ["--models", "MobileNetV2", "--size", "96", "--rounds", "2", "--iters", "2",
                 "--probe-rounds", "1", "--probe-iters", "2"]
    else:
        argv += ["--models", "MobileNetV2,ResNet50,DenseNet121", "--rounds", "5", "--iters", "3"]
    if not (H.REPO / argv[0]).is_file():
        bar.update(task, advance=1)
        return {"skipped": f"{argv[0]} is missing"}
    rc, tail = H.run_script(argv, timeout=240 if args.quick else 600, log_path=sub / "keras_settings.log",
                            env=ctx["env"])
    bar.update(task, advance=1)
    res_file = sub / "keras_settings.json"
    if rc != 0 or not res_file.is_file():
        return {"skipped": f"bench/keras_settings.py exited with status {rc}: {tail}"}
    data = json.loads(res_file.read_text())
    return {"command": "python " + " ".join(shlex.quote(a) for a in argv), "result": data}


# ======================================================================= section 2: simulator scale
def heldout_specs() -> tuple[list[str], str]:
    from opsched.agents.config import DEFAULT_HELDOUT_GRAPHS

    return list(DEFAULT_HELDOUT_GRAPHS), "opsched.agents.config.DEFAULT_HELDOUT_GRAPHS"


def load_spec(spec: str) -> Any:
    from opsched.specs import load_graph

    return load_graph(spec)


def section_sim(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    from opsched.backends.sim import SimBackend
    from opsched.engine.sim import lower_bound
    from opsched.machine import get_machine, preset_names
    from opsched.policies import HEURISTICS, get_policy, timed_plan

    specs, source = heldout_specs()
    if args.quick:
        specs = [s for s in specs if not s.startswith("zoo:")][:2] + [s for s in specs if s.startswith("zoo:")][:1]
    presets = [p for p in preset_names() if p != "local"]
    names = list(HEURISTICS) + ["search"] + (["learned"] if ctx["learned"] is not None else [])
    task = bar.add_task("2 simulator scale", total=len(specs) * len(presets) * len(names), detail="")
    graphs, rows, skipped = {}, [], {}
    for spec in specs:
        bar.update(task, detail=f"load {spec}")
        try:
            with _quiet():
                graphs[spec] = load_spec(spec)
        except Exception as exc:
            skipped[spec] = f"{type(exc).__name__}: {exc}"
            bar.update(task, advance=len(presets) * len(names))
    for pname in presets:
        machine = get_machine(pname)
        sim = SimBackend(machine)
        for spec, graph in graphs.items():
            lb = lower_bound(graph, machine)
            seq = None
            for name in names:
                bar.update(task, detail=f"{pname} {spec} {name}")
                try:
                    pol = (ctx["learned"] if name == "learned" else
                           get_policy(name, n_trials=args.search_trials) if name == "search" else get_policy(name))
                    plan, dt = timed_plan(pol, graph, machine)
                    ms = float(sim.run(graph, plan).makespan)
                except Exception as exc:
                    skipped[f"{pname}/{spec}/{name}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    bar.update(task, advance=1)
                    continue
                if name == "sequential":
                    seq = ms
                rows.append({"machine": pname, "graph": spec, "ops": len(graph.ops), "policy": name,
                             "makespan_s": ms, "lower_bound_s": lb, "lb_ratio": ms / lb if lb > 0 else float("nan"),
                             "decision_s": dt})
                bar.update(task, advance=1)
            for r in rows:
                if r["machine"] == pname and r["graph"] == spec:
                    r["speedup"] = (seq / r["makespan_s"]) if seq and r["makespan_s"] > 0 else float("nan")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for pname in presets:
        for name in names:
            sel = [r for r in rows if r["machine"] == pname and r["policy"] == name]
            if sel:
                summary.setdefault(pname, {})[name] = {
                    "gmean_lb_ratio": H.geomean(r["lb_ratio"] for r in sel),
                    "gmean_speedup": H.geomean(r.get("speedup", float("nan")) for r in sel),
                    "median_decision_s": H.stats(r["decision_s"] for r in sel)["median"], "graphs": len(sel)}
    return {"graphs": specs, "graph_source": source, "presets": presets, "policies": names,
            "search_trials": args.search_trials, "performance_model": "analytic (preset machines)",
            "learned": ctx["learned_where"], "rows": rows, "summary": summary, "skipped": skipped}


# ======================================================================= section 3: costs
def _sub_bench(script: str, argv: list[str], out: Path, timeout: float, env: dict[str, str],
               keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``bench/<script>`` into ``out/sub`` and keep its summary (or ``keys`` of its JSON)."""
    sub = out / "sub"
    if not (H.REPO / "bench" / script).is_file():
        return {"skipped": f"bench/{script} is missing"}
    full = [f"bench/{script}", *argv, "--out", str(sub)]
    rc, tail = H.run_script(full, timeout=timeout, log_path=sub / f"{Path(script).stem}.log", env=env)
    res_file = sub / f"{Path(script).stem}.json"
    if rc != 0 or not res_file.is_file():
        return {"skipped": f"bench/{script} exited with status {rc}: {tail}"}
    data = json.loads(res_file.read_text())
    return {"command": "python " + " ".join(shlex.quote(a) for a in full),
            "summary": ({k: data[k] for k in keys if k in data} if keys else
                        data.get("summary") or data.get("headline") or {}),
            "raw_file": str(res_file.relative_to(out))}


def planning_times(ctx: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Median time for the heuristics that plan by simulation (critical-path-first,
    heft) to produce a Plan, by graph size, on knl-68 -- the scale the exported
    scheduler's planning time (``bench/plan_speed.py``) is read against."""
    import numpy as np

    from opsched.machine import get_machine
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    sizes = (25, 50, 100, 200) if quick else (25, 50, 100, 200, 400, 800)
    reps = 3 if quick else 5
    machine = get_machine("knl-68")
    pols: list[tuple[str, Any]] = []  # the exported scheduler is timed by bench/plan_speed.py (one core, BLAS 1 thread)
    for name in ("critical-path-first", "heft"):
        with contextlib.suppress(Exception):
            pols.append((name, get_policy(name)))
    rows = []
    for n in sizes:
        g = generate("layered", n, 7)
        for name, pol in pols:
            ts = []
            try:
                pol.plan(g, machine)  # warm caches (time tables, fingerprints)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    pol.plan(g, machine)
                    ts.append(time.perf_counter() - t0)
            except Exception as exc:
                rows.append({"ops": n, "policy": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append({"ops": n, "policy": name, "median_ms": float(np.median(ts)) * 1e3,
                         "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3})
    return {"machine": "knl-68", "family": "layered", "repeats": reps, "rows": rows,
            "learned": ctx["learned_where"]}


def train_time_to_beat_cpf(runs_root: Path | None = None) -> dict[str, Any]:
    """From the newest *default* training run's evaluations.csv (today's
    default hyperparameters - the resolved values the run recorded, so a run
    of an older default does not count - and seed 0, in the simulator, not
    fine-tuned from another run; the newest run of any kind when there is
    none): the first evaluation at which the held-out geometric-mean ratio to
    critical-path-first is <= 1."""
    import csv

    import yaml

    from opsched.agents.config import load_hyperparams

    default_ppo = load_hyperparams("default")

    def is_default(run: Path) -> bool:
        try:
            cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return False
        ppo = cfg.get("ppo") or {}
        return (cfg.get("hyperparams") == "default" and cfg.get("backend", "sim") == "sim" and not cfg.get("init")
                and all(ppo.get(k) == v for k, v in default_ppo.items()) and cfg.get("seed", 0) == 0)

    root = runs_root or H.REPO / "runs"
    files = sorted(root.glob("*/evaluations.csv"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not files:
        return {"skipped": "no training run with evaluations.csv under runs/ (run `opsched train-policy`)"}
    f = next((x for x in files if is_default(x.parent)), files[0])
    with open(f, newline="") as fh:
        rows = list(csv.DictReader(fh))
    key = next((k for k in ("gmean_cpf", "gmean_critical_path_first") if rows and k in rows[0]), None)
    if key is None:
        return {"skipped": f"{f}: no gmean_cpf column", "run": str(f.parent)}
    first = next((r for r in rows if float(r[key]) <= 1.0), None)
    last = rows[-1]
    cmd = f.parent / "command.txt"
    res = {"run": str(f.parent.relative_to(root.parent)), "evaluations": len(rows),
           "command": cmd.read_text().strip() if cmd.is_file() else None,
           "final_gmean_cpf": float(last[key]), "final_steps": float(last.get("timesteps", "nan")),
           "final_wall_s": float(last.get("wall_s", "nan"))}
    if first is None:
        res["beat_cpf"] = False
    else:
        res.update(beat_cpf=True, steps=float(first.get("timesteps", "nan")), wall_s=float(first.get("wall_s", "nan")),
                   gmean_cpf=float(first[key]))
    return res


def section_costs(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    task = bar.add_task("3 costs", total=6, detail="")
    q = ["--quick"] if args.quick else []
    res: dict[str, Any] = {}
    subs: list[tuple[str, str, list[str], float, tuple[str, ...]]] = [
        ("runtime_overhead", "runtime_overhead.py", q or ["--rounds", "40", "--zoo-rounds", "10"], 300, ()),
        ("sim_speed", "sim_speed.py", q, 300, ()),
        ("env_speed", "env_speed.py", q, 300, ()),
    ]
    if ctx["learned"] is not None:
        subs.append(("plan_speed", "plan_speed.py", [*q, "--policy", ctx["learned_where"]], 300,
                     ("target", "met", "met_worst", "by_size")))
    else:
        res["plan_speed"] = {"skipped": f"the exported scheduler's planning speed needs a learned policy: "
                                        f"{ctx['learned_where']}"}
        bar.update(task, advance=1)
    for key, script, argv, limit, keys in subs:
        bar.update(task, detail=script)
        try:
            res[key] = _sub_bench(script, argv, out, limit, ctx["env"], keys)
        except Exception as exc:
            res[key] = {"skipped": f"{type(exc).__name__}: {exc}"}
        bar.update(task, advance=1)
    bar.update(task, detail="planning time")
    try:
        res["planning"] = planning_times(ctx, args.quick)
    except Exception as exc:
        res["planning"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    ps = res.get("plan_speed", {}).get("summary", {}).get("by_size", {})
    if "rows" in res.get("planning", {}):
        res["planning"]["rows"] += [{"ops": int(n), "policy": "learned (plan_speed.py, CPU)",
                                     "median_ms": v["median_cpu_ms"], "max_ms": v.get("max_cpu_ms")}
                                    for n, v in ps.items() if "median_cpu_ms" in v]
    bar.update(task, advance=1, detail="train run")
    res["train_to_beat_cpf"] = train_time_to_beat_cpf()
    bar.update(task, advance=1)
    return res


# ======================================================================= section 4: fidelity
def fidelity_plans(graph: Any, machine: Any, model: Any, n: int) -> dict[str, Any]:
    """``n`` varied plans: sequential at each thread level, one-thread chains,
    the heuristics, per-op random thread counts in topological order, and
    co-running variants (random priorities)."""
    import numpy as np

    from opsched.plan import Assignment, Plan, uniform_plan
    from opsched.policies import get_policy

    cpu = machine.cpu
    levels = list(cpu.thread_levels())
    plans: dict[str, Any] = {}

    def add(name: str, plan: Any) -> None:
        if len(plans) < n and all(p.assignments != plan.assignments for p in plans.values()):
            plans[name] = plan

    for k in levels:
        add(f"uniform-{k}t", uniform_plan(graph, machine, k, policy=f"uniform-{k}t"))
    for name in ("sequential", "critical-path-first", "heft", "tf-recommended", "tf-default"):
        with contextlib.suppress(Exception):
            add(name, get_policy(name).plan(graph, machine, model))
    rng = np.random.default_rng(0)
    topo = {i: float(len(graph.ops) - r) for r, i in enumerate(graph.topo_index)}
    k = 0
    while len(plans) < n and k < 4 * n:
        k += 1
        variant = k % 3
        asg = {}
        for i, op in enumerate(graph.ops):
            if variant == 0:      # per-op thread counts, topological order
                asg[op.id] = Assignment("cpu", int(rng.choice(levels)), topo[i])
            elif variant == 1:    # co-running: one thread each, random order
                asg[op.id] = Assignment("cpu", 1, float(rng.random()))
            else:                 # mixed: random threads and order
                asg[op.id] = Assignment("cpu", int(rng.choice(levels)), float(rng.random()))
        tag = ("threads", "corun", "mixed")[variant]
        add(f"{tag}-{k}", Plan.build(graph, machine, asg, policy=f"{tag}-{k}"))
    return plans


def section_fidelity(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    """``bench/sim_to_real.py`` (the execution issue's own sim-to-real benchmark)
    when it runs here; otherwise the in-house measurement below.  Either way the
    error and rank correlation are computed here from its rows, for every
    simulated column it gives (raw, calibrated)."""
    models = zoo_models(args)[:1] if args.quick and not args.models else zoo_models(args)
    task = bar.add_task("4 fidelity", total=len(models) * (args.rounds + 3), detail="")
    script = H.REPO / "bench" / "sim_to_real.py"
    why_not = "bench/sim_to_real.py is missing"
    if script.is_file():
        bar.update(task, detail="bench/sim_to_real.py")
        sub = out / "sub" / "sim_to_real"
        argv = ["bench/sim_to_real.py", "--models", ",".join(models), "--out", str(sub), *(["--quick"] if args.quick else [])]
        rc, tail = H.run_script(argv, timeout=240 if args.quick else 900, log_path=sub / "sim_to_real.log",
                                env=ctx["env"])
        rows = _script_rows(sub) if rc == 0 else None
        if rows:
            bar.update(task, completed=len(models) * (args.rounds + 3))
            res = fidelity_metrics(rows, models)
            res.update(source="python " + " ".join(shlex.quote(a) for a in argv), rounds=None,
                       performance_model="fitted (FittedModel.from_cache), as bench/sim_to_real.py uses it")
            return res
        why_not = (f"bench/sim_to_real.py exited with status {rc}: {tail}" if rc != 0 else
                   "bench/sim_to_real.py wrote no rows with model, plan, measured_s and simulated_*_s")
    res = fidelity_inhouse(args, ctx, out, bar, task, models)
    res["source"] = f"in-house measurement in bench/run_all.py ({why_not})"
    return res


def _script_rows(sub: Path) -> list[dict[str, Any]] | None:
    """Rows ``{model, plan, measured_s, simulated_<kind>_s...}`` from sim_to_real's JSON, if it has them."""
    for name in ("sim_to_real.json", "sim_to_real_raw.json"):
        f = sub / name
        if not f.is_file():
            continue
        rows = json.loads(f.read_text()).get("rows") or []
        ok = [r for r in rows if {"model", "plan", "measured_s"} <= set(r)
              and any(k.startswith("simulated") and k.endswith("_s") for k in r)]
        if ok:
            return ok
    return None


def fidelity_metrics(rows: list[dict[str, Any]], models: list[str], skipped: dict[str, str] | None = None
                     ) -> dict[str, Any]:
    """Per model and overall, for each ``simulated*_s`` column: median absolute
    percentage error and Spearman's rank correlation across plans."""
    import numpy as np

    keys = sorted({k for r in rows for k in r if k.startswith("simulated") and k.endswith("_s")},
                  key=lambda k: (k != "simulated_s", "raw" not in k, k))

    def score(sel: list[dict[str, Any]], key: str) -> dict[str, float]:
        pairs = [(r[key], r["measured_s"]) for r in sel if r.get(key) and r["measured_s"] > 0]
        if not pairs:
            return {"median_ape": float("nan"), "spearman": float("nan")}
        sim, meas = zip(*pairs)
        ape = [abs(a - b) / b for a, b in pairs]
        return {"median_ape": float(np.median(ape)), "spearman": H.spearman(sim, meas)}

    per_model = {}
    for m in models:
        sel = [r for r in rows if r["model"] == m]
        if sel:
            per_model[m] = {"plans": len(sel), "profiled": sel[0].get("profiled"),
                            **{k: score(sel, k) for k in keys}}
    overall = {"plans": len(rows)}
    for k in keys:
        pooled = score(rows, k)
        overall[k] = {"median_ape": pooled["median_ape"], "spearman": pooled["spearman"],
                      "median_spearman": float(np.nanmedian([v[k]["spearman"] for v in per_model.values()]))
                      if per_model else float("nan")}
    return {"models": models, "sim_keys": keys, "targets": {"median_ape": 0.15, "spearman": 0.8},
            "rows": rows, "per_model": per_model, "overall": overall, "skipped": skipped or {}}


def fidelity_inhouse(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any, task: Any,
                     models: list[str]) -> dict[str, Any]:
    """Plans of :func:`fidelity_plans` simulated with this machine's performance
    model and measured (``TorchCPUBackend.run(...).makespan``) in one worker
    process per model, interleaved rounds after a warm-up."""
    from opsched.backends.sim import SimBackend
    from opsched.importers.torch_fx import from_torch
    from opsched.specs import load_torch_model

    machine, model = ctx["machine"], ctx["model"]
    sim = SimBackend(machine, model=model)
    rows, skipped = [], {}
    work = out / "sub" / "fidelity"
    for m in models:
        bar.update(task, detail=f"{m}: plans")
        mdir = work / m / "plans"
        mdir.mkdir(parents=True, exist_ok=True)
        try:
            module, inputs = load_torch_model(f"zoo:{m}", 1)
            with _quiet():
                graph = from_torch(module, inputs, name=m)
            del module
            plans = fidelity_plans(graph, machine, model, args.fidelity_plans)
            predicted = {name: float(sim.run(graph, p).makespan) for name, p in plans.items()}
            for name, p in plans.items():
                p.save(mdir / f"{name}.json")
            bar.update(task, advance=1, detail=f"{m}: start")
            w = H.Worker("plans", ["--kind", "plans-trace", "--model", m, "--batch", "1", "--plans", str(mdir),
                                   "--machine", str(ctx["machine_file"])], work / m / "worker.log", env=ctx["env"])
            fails = H.start_all([w], args.init_timeout)
            if fails:
                raise RuntimeError(fails["plans"])
            try:
                configs = [(c, w, c) for c in w.info["configs"]]
                bar.update(task, advance=1, detail=f"{m}: measure")
                samples, tfail = H.interleave(configs, args.rounds, 1, 1, timeout=max(120.0, args.init_timeout),
                                              settle_s=0.0, on_step=None)
            finally:
                w.close()
            for name, why in tfail.items():
                skipped[f"{m}/{name}"] = why
            prof = profile_status(graph, machine)
            for name, xs in samples.items():
                s = H.stats(xs)
                rows.append({"model": m, "plan": name, "simulated_s": predicted[name], "measured_s": s["median"],
                             "measured_q1_s": s["q1"], "measured_q3_s": s["q3"], "profiled": prof})
        except Exception as exc:
            skipped[m] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(file=ctx["log"])
        bar.update(task, advance=args.rounds + 1)
    res = fidelity_metrics(rows, models, skipped)
    res.update(rounds=args.rounds, performance_model=ctx["model_note"])
    return res


def profile_status(graph: Any, machine: Any) -> bool:
    try:
        from opsched.backends.profiler import cache_path

        return cache_path(graph, machine).is_file()
    except Exception:
        return False


def profile_missing(models: list[str], batches: list[int], ctx: dict[str, Any], out: Path) -> dict[str, str]:
    """``--profile``: profile each (model, batch) without a cached profile, in a subprocess."""
    notes = {}
    for m in models:
        for b in sorted(set(batches) | {1}):
            code = ("from opsched.backends.profiler import profile_graph; from opsched.specs import load_graph; "
                    f"profile_graph(load_graph('zoo:{m}', {b}), progress=False)")
            rc, tail = H.run_script(["-c", code], timeout=900, log_path=out / "sub" / f"profile_{m}_b{b}.log",
                                    env=ctx["env"])
            notes[f"{m} b{b}"] = "ok" if rc == 0 else f"failed ({rc}): {tail}"
    return notes


# ======================================================================= main
def main(argv: list[str] | None = None, command: str | None = None) -> Path:
    """Run the selected sections; return the run folder.  ``command`` is the
    command line recorded in the report (default: this script's)."""
    from rich.console import Console

    from opsched.io import atomic_write_text, next_run_dir

    args = parse_args(argv)
    zoo_models(args)  # an unknown --models name stops here, before a run folder exists
    console = Console(stderr=True)
    out = next_run_dir(args.out, "bench")
    raw = list(sys.argv[1:] if argv is None else argv)
    command = command or ("python bench/run_all.py" + "".join(" " + shlex.quote(a) for a in raw))
    atomic_write_text(out / "command.txt", command + "\n")
    t_start = time.perf_counter()
    # The driver only plans and reports (workers measure, with their own
    # environment): its numpy/OpenMP pools at one thread keep decision times
    # comparable to bench/plan_speed.py's and out of the workers' way.
    with contextlib.suppress(Exception):
        from threadpoolctl import threadpool_limits

        ctx_limits = threadpool_limits(1)  # noqa: F841 - held for the whole run
    desc = H.machine_description()
    versions = H.package_versions()
    atomic_write_text(out / "machine.json", json.dumps(desc, indent=1))
    atomic_write_text(out / "versions.json", json.dumps(versions, indent=1))
    results: dict[str, Any] = {"command": command, "quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "machine": desc, "versions": versions, "settings": vars(args), "sections": {}}
    log = open(out / "errors.log", "w")  # noqa: SIM115 - tracebacks of skipped parts, closed below
    ctx: dict[str, Any] = {"env": H.worker_env(), "log": log, "onnx_dir": Path(args.out) / "onnx_cache"}
    ctx["onnx_dir"].mkdir(parents=True, exist_ok=True)
    try:
        from opsched.machine import Machine

        ctx["machine"] = Machine.probe()
        ctx["machine_file"] = out / "sub" / "machine_probe.json"
        ctx["machine_file"].parent.mkdir(parents=True, exist_ok=True)
        ctx["machine_file"].write_text(json.dumps(ctx["machine"].to_dict()))
        if args.profile:
            console.print("profiling zoo models without a cached profile ...")
            results["profiling"] = profile_missing(zoo_models(args), args.batches, ctx, out)
        ctx["model"], ctx["model_note"] = perf_model(ctx["machine"])
        ctx["learned"], ctx["learned_where"] = find_learned_policy(args.policy)
        results["performance_model"], results["learned"] = ctx["model_note"], ctx["learned_where"]
        runners = {"real": section_real, "keras": section_keras, "sim": section_sim, "costs": section_costs,
                   "fidelity": section_fidelity}

        def save() -> None:
            results["elapsed_s"] = time.perf_counter() - t_start
            results["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str))
            write_report(out, results)

        with H.progress_bar(console, disable=args.no_progress) as bar:
            for key in args.sections:
                try:
                    sec = runners[key](args, ctx, out, bar)
                except KeyboardInterrupt:
                    results["sections"][key] = {"skipped": "interrupted (Ctrl-C)"}
                    save()
                    raise
                except Exception as exc:
                    traceback.print_exc(file=log)
                    sec = {"skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}
                if key == "real" and "groups" in sec:
                    sec["performance_model"] = ctx["model_note"]
                results["sections"][key] = sec
                save()
        results["figures"] = write_figures(out, results)
        save()
    finally:
        log.close()
    console.print(f"[bold green]report:[/bold green] {out / 'report.md'} ({(time.perf_counter() - t_start) / 60:.1f} min)")
    return out


if __name__ == "__main__":
    main()
