"""The sections of ``opsched bench`` (:mod:`opsched.benchmarks.run_all`): each returns its figures as a dict.

1. ``real`` -- every zoo model at batch 1 and 8 on this machine, as a ratio
   to eager PyTorch: eager at one thread, ``torch.compile``, ONNX Runtime,
   and opsched's policies on its PyTorch CPU runtime, each configuration in
   its own process (:class:`~opsched.benchmarks.harness.Worker`), outputs
   checked against eager's; ``keras``: TensorFlow's thread settings
   (:mod:`opsched.benchmarks.keras_settings`).
2. ``sim`` -- the validation graphs on every preset machine in the simulator.
3. ``costs`` -- runtime overhead, simulator and environment speed, planning
   time, and the time training took to beat critical-path-first.
4. ``fidelity`` -- :mod:`opsched.benchmarks.sim_to_real`.

A section whose dependency does not import or fails says ``skipped: <reason>``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import opsched.benchmarks.harness as H
import opsched.timing as T
from opsched.errors import OpschedError
from opsched.policies import BASELINE, Policy, names

if TYPE_CHECKING:
    from opsched.engine.contracts import PerfModel
    from opsched.graph import OpGraph
    from opsched.machine import Machine
    from opsched.plan import Plan

QUICK_MODELS = ("transformer", "lstm")
#: Calls per configuration per round: as many as fit in this many seconds, at most --iters.
ITER_TARGET_S = 0.25


def zoo_models(args: argparse.Namespace) -> list[str]:
    from opsched.zoo import ZOO

    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in names if m not in ZOO]
        if unknown:
            raise OpschedError(f"unknown zoo model(s) {', '.join(unknown)}; zoo: {', '.join(ZOO)}")
        return names
    return list(QUICK_MODELS) if args.quick else list(ZOO)


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
    """The cached export's file name: the model, the batch, torch's version and the zoo sources."""
    import hashlib
    from importlib import resources

    import torch

    from opsched.zoo import ZOO

    zoo = resources.files("opsched.zoo")
    h = hashlib.sha256(f"{torch.__version__}|{model}|{batch}".encode())
    for name in (f"{ZOO[model].module}.py", "_layers.py"):
        if zoo.joinpath(name).is_file():
            h.update(zoo.joinpath(name).read_bytes())
    return f"{model}_b{batch}_{h.hexdigest()[:12]}.onnx"


def policy_plans(graph: OpGraph, machine: Machine, model: PerfModel, learned: Policy | None
                 ) -> tuple[dict[str, Plan], dict[str, float], dict[str, str], dict[str, str]]:
    """Every opsched policy's plan for ``graph``: (plans, decision seconds,
    {policy: identical earlier policy}, {policy: failure})."""
    from opsched.policies import get_policy, timed_plan

    plans, decide, same, failed = {}, {}, {}, {}
    pols: list[tuple[str, Policy]] = []
    for name in names(BASELINE):
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
    plans, decide, same, failed = policy_plans(graph, ctx["machine"], ctx["model"], ctx["learned"])
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
        learned = ctx.get("learned")
        specs.append(("opsched-ort", ["--profiles", str(args.profiles),
                                      *(["--policy", str(learned.folder)] if learned is not None else [])]))
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
        timings, tfail = H.time_workers(configs, args.rounds, args.iters, args.warmup,
                                        timeout=max(120.0, args.init_timeout), on_step=step, target_s=ITER_TARGET_S)
        res["skipped"].update(tfail)
    finally:
        for w in workers:
            w.close()
    res["round_medians_s"] = timings.samples
    res["time_s"] = {k: timings.stats(k) for k in timings.samples}
    res["ratio"] = timings.ratios("eager")
    res["load"], res["load_warning"] = timings.load_record(), timings.warning()
    return res


def opsched_label(ctx: dict[str, Any]) -> str:
    return "learned" if ctx.get("learned") is not None else "critical-path-first"


def section_real(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    models = zoo_models(args)
    groups = [(m, b) for m in models for b in args.batches]
    # per group: 4 setup steps, then warm-up + rounds over ~11 configurations
    per_group = 4 + (args.rounds + 1) * (6 + len(names(BASELINE)) + 1)
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
    from importlib.util import find_spec

    task = bar.add_task("1b TensorFlow (Keras)", total=1, detail="keras_settings")
    if find_spec("tensorflow") is None:  # not imported here: the benchmark runs in its own process
        bar.update(task, advance=1)
        return {"skipped": "TensorFlow is not installed (pip install 'opsched[tf]')"}
    sub = out / "sub"
    argv = ["--out", str(sub)]
    if args.quick:
        argv += ["--models", "MobileNetV2", "--size", "96", "--rounds", "2", "--iters", "2",
                 "--probe-rounds", "1", "--probe-iters", "2"]
    else:
        argv += ["--models", "MobileNetV2,ResNet50,DenseNet121", "--rounds", "5", "--iters", "3"]
    res = _sub_bench("keras_settings", argv, out, 240 if args.quick else 600, ctx["env"], keys=None)
    bar.update(task, advance=1)
    return res


# ======================================================================= section 2: simulator scale
def section_sim(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    from opsched.agents.config import DEFAULT_VALIDATION_GRAPHS
    from opsched.backends.sim import SimBackend
    from opsched.engine.bounds import allocation_lp_bound
    from opsched.engine.sim import lower_bound
    from opsched.machine import get_machine, preset_names
    from opsched.policies import get_policy, heuristic_names, timed_plan
    from opsched.specs import load_graph

    specs, source = list(DEFAULT_VALIDATION_GRAPHS), "opsched.agents.config.DEFAULT_VALIDATION_GRAPHS"
    if args.quick:
        specs = [s for s in specs if not s.startswith("zoo:")][:2] + [s for s in specs if s.startswith("zoo:")][:1]
    presets = [p for p in preset_names() if p != "local"]
    learned: Policy | None = ctx["learned"]
    names = list(heuristic_names()) + ["search"] + (["learned"] if learned is not None else [])
    task = bar.add_task("2 simulator scale", total=len(specs) * len(presets) * len(names), detail="")
    graphs, rows, skipped = {}, [], {}
    for spec in specs:
        bar.update(task, detail=f"load {spec}")
        try:
            with _quiet():
                graphs[spec] = load_graph(spec)
        except Exception as exc:
            skipped[spec] = f"{type(exc).__name__}: {exc}"
            bar.update(task, advance=len(presets) * len(names))
    for pname in presets:
        machine = get_machine(pname)
        sim = SimBackend(machine)
        for spec, graph in graphs.items():
            lb = lower_bound(graph, machine)
            lp = allocation_lp_bound(graph, machine)  # the tighter bound (issue 23)
            seq = None
            for name in names:
                bar.update(task, detail=f"{pname} {spec} {name}")
                try:
                    if name == "learned":
                        assert learned is not None  # "learned" is among the names only when there is one
                        pol = learned
                    else:
                        pol = (get_policy(name, n_trials=args.search_trials) if name == "search"
                               else get_policy(name))
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
                             "decision_s": dt, "lp_bound_s": lp, "tight_lb_ratio": ms / lp if lp > 0 else float("nan")})
                bar.update(task, advance=1)
            mine = [r for r in rows if r["machine"] == pname and r["graph"] == spec]
            best = min((r["makespan_s"] for r in mine), default=float("nan"))  # the best known plan of the pair
            for r in mine:
                r["speedup"] = (seq / r["makespan_s"]) if seq and r["makespan_s"] > 0 else float("nan")
                r["best_known_s"], r["best_known_ratio"] = best, r["makespan_s"] / best
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for pname in presets:
        for name in names:
            sel = [r for r in rows if r["machine"] == pname and r["policy"] == name]
            if sel:
                summary.setdefault(pname, {})[name] = {
                    "gmean_lb_ratio": T.geomean(r["lb_ratio"] for r in sel),
                    "gmean_tight_lb_ratio": T.geomean(r["tight_lb_ratio"] for r in sel),
                    "gmean_best_known_ratio": T.geomean(r["best_known_ratio"] for r in sel),
                    "gmean_speedup": T.geomean(r.get("speedup", float("nan")) for r in sel),
                    "median_decision_s": T.summary(r["decision_s"] for r in sel)["median"], "graphs": len(sel)}
    return {"graphs": specs, "graph_source": source, "presets": presets, "policies": names,
            "search_trials": args.search_trials, "performance_model": "analytic (preset machines)",
            "learned": ctx["learned_where"], "rows": rows, "summary": summary, "skipped": skipped}


# ======================================================================= section 3: costs
def _sub_bench(name: str, argv: list[str], out: Path, timeout: float, env: dict[str, str],
               keys: tuple[str, ...] | None = ()) -> dict[str, Any]:
    """Run the benchmark ``opsched.benchmarks.<name>`` in its own process into
    ``out/sub`` and keep its summary (``keys`` of its JSON; ``None``: all of it, as ``result``)."""
    sub = out / "sub"
    module = f"opsched.benchmarks.{name}"
    full = [*argv, "--out", str(sub)] if "--out" not in argv else list(argv)
    rc, tail = H.run_module(module, full, timeout=timeout, log_path=sub / f"{name}.log", env=env)
    res_file = sub / f"{name}.json"
    if rc != 0 or not res_file.is_file():
        return {"skipped": f"python -m {module} exited with status {rc}: {tail}"}
    data = json.loads(res_file.read_text())
    command = shlex.join(["python", "-m", module, *full])
    if keys is None:
        return {"command": command, "result": data}
    return {"command": command, "raw_file": str(res_file.relative_to(out)),
            "summary": {k: data[k] for k in keys if k in data} if keys else
            data.get("summary") or data.get("headline") or {}}


def planning_times(ctx: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Median time for the heuristics that plan by simulation (critical-path-first,
    heft) to produce a Plan, by graph size, on knl-68 -- the scale the exported
    scheduler's planning time (:mod:`opsched.benchmarks.plan_speed`) is read against."""
    from opsched.machine import get_machine
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    sizes = (25, 50, 100, 200) if quick else (25, 50, 100, 200, 400, 800)
    reps = 3 if quick else 5
    machine = get_machine("knl-68")
    pols: list[tuple[str, Any]] = []  # the exported scheduler is timed by plan_speed (one core, BLAS 1 thread)
    for name in ("critical-path-first", "heft"):
        with contextlib.suppress(Exception):
            pols.append((name, get_policy(name)))
    rows = []
    for n in sizes:
        g = generate("layered", n, 7)
        for name, pol in pols:
            try:  # one warm-up call fills the caches (time tables, fingerprints)
                s = T.interleave({name: T.wall_clock(lambda p=pol, g=g: p.plan(g, machine))}, 1, reps).stats(name)
            except Exception as exc:
                rows.append({"ops": n, "policy": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append({"ops": n, "policy": name, "median_ms": s["median"] * 1e3, "min_ms": s["min"] * 1e3,
                         "max_ms": s["max"] * 1e3})
    return {"machine": "knl-68", "family": "layered", "repeats": reps, "rows": rows,
            "learned": ctx["learned_where"]}


def train_time_to_beat_cpf(runs_root: Path | None = None) -> dict[str, Any]:
    """From the newest *default* training run's evaluations.csv (today's
    default hyperparameters - the resolved values the run recorded, so a run
    of an older default does not count - and seed 0, in the simulator, not
    fine-tuned from another run; the newest run of any kind when there is
    none): the first evaluation at which the validation geometric-mean ratio to
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

    root = Path(runs_root or "runs")
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
    subs: list[tuple[str, list[str], float, tuple[str, ...]]] = [
        ("runtime_overhead", q or ["--rounds", "40", "--zoo-rounds", "10"], 300, ()),
        ("sim_speed", q, 300, ()),
        ("env_speed", q, 300, ()),
    ]
    if ctx["learned"] is not None:
        subs.append(("plan_speed", [*q, "--policy", ctx["learned_where"]], 300, ("target", "met", "met_worst",
                                                                                 "by_size")))
    else:
        res["plan_speed"] = {"skipped": f"the exported scheduler's planning speed needs a learned policy: "
                                        f"{ctx['learned_where']}"}
        bar.update(task, advance=1)
    for key, argv, limit, keys in subs:
        bar.update(task, detail=key)
        try:
            res[key] = _sub_bench(key, argv, out, limit, ctx["env"], keys)
        except Exception as exc:
            res[key] = {"skipped": f"{type(exc).__name__}: {exc}"}
        bar.update(task, advance=1)
    bar.update(task, detail="planning time")
    planning: dict[str, Any]
    try:
        planning = planning_times(ctx, args.quick)
    except Exception as exc:
        planning = {"skipped": f"{type(exc).__name__}: {exc}"}
    res["planning"] = planning
    ps = res.get("plan_speed", {}).get("summary", {}).get("by_size", {})
    if "rows" in planning:
        planning["rows"] += [{"ops": int(n), "policy": "learned (plan_speed, CPU)",
                                     "median_ms": v["median_cpu_ms"], "max_ms": v.get("max_cpu_ms")}
                                    for n, v in ps.items() if "median_cpu_ms" in v]
    bar.update(task, advance=1, detail="train run")
    res["train_to_beat_cpf"] = train_time_to_beat_cpf(Path(args.out))
    bar.update(task, advance=1)
    return res


# ======================================================================= section 4: fidelity
def section_fidelity(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    """:mod:`opsched.benchmarks.sim_to_real` on the zoo models (quick: the first one), its
    files in ``sub/sim_to_real/``; skipped, with the reason, where there is no fitted planning model."""
    from opsched.benchmarks import sim_to_real as S

    models = zoo_models(args)[:1] if args.quick and not args.models else zoo_models(args)
    sub = out / "sub" / "sim_to_real"
    argv = ["--models", ",".join(models), "--out", str(sub), "--profiles", str(args.profiles),
            "--plans-per-model", str(args.fidelity_plans), *(["--quick"] if args.quick else [])]
    task = bar.add_task("4 fidelity", total=1, detail="")
    try:
        res = S.evaluate(S.parse_args(argv), shlex.join(["python", "-m", "opsched.benchmarks.sim_to_real", *argv]),
                         lambda what, done, total: bar.update(task, completed=done, total=total, detail=what))
    except OpschedError as exc:
        return {"skipped": str(exc)}
    S.write_outputs(res, sub)
    res = {k: v for k, v in res.items() if k not in ("measurement", "digests")}
    res["report"] = str((sub / "sim_to_real.md").relative_to(out))
    return res


# ======================================================================= section 5: ort fidelity
def section_ort(args: argparse.Namespace, ctx: dict[str, Any], out: Path, bar: Any) -> dict[str, Any]:
    """The ``ort`` backend's planning model against fresh plans measured on ONNX
    Runtime (:func:`opsched.benchmarks.ort_bench.sim_to_real`); skipped, with the
    reason, where ``opsched profile --backend ort`` has not fitted one."""
    from opsched.benchmarks.ort_bench import sim_to_real

    models = zoo_models(args)[:1] if args.quick and not args.models else zoo_models(args)
    task = bar.add_task("5 ort fidelity", total=len(models), detail="")
    done = 0

    def say(msg: str) -> None:
        nonlocal done
        if msg.startswith("sim-to-real:"):
            done += 1
        bar.update(task, completed=min(done, len(models)), detail=msg[:60])

    try:
        res = sim_to_real(models, (1,), cache_dir=args.profiles, progress=say)
    except Exception as exc:  # a section that fails is reported, the others still run
        traceback.print_exc(file=ctx["log"])
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    bar.update(task, completed=len(models))
    if "error" in res:
        return {"skipped": res["error"]}
    return {k: v for k, v in res.items() if k != "plans"}
