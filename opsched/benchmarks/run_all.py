"""Every opsched benchmark in one command: against what users would pick instead, and the physical limit.

    opsched bench [--quick]                         # full run (<= 30 min on a 2-core machine); smoke run
    python -m opsched.benchmarks.run_all [--quick]  # the same

Writes ``runs/bench_<N>/``: ``report.md`` (the headline table first, with the
command and machine that produced it), ``results.json`` (every raw figure),
PNG figures, ``command.txt``, ``machine.json`` and ``versions.json``, and
under ``sub/`` the outputs of the benchmarks it runs, the plans and the
worker logs; ``errors.log`` holds the tracebacks behind any "skipped".  ONNX
exports are cached in ``runs/onnx_cache/``.  opsched plans with the model
``opsched apply`` plans with (:func:`opsched.planning.planning_model`: the
profiles and runtime model ``opsched profile`` cached, else the analytic
model); ``--profile`` first runs ``opsched profile`` on the zoo models that
have none (minutes per model, outside the 30-minute budget).
``python -m opsched.benchmarks.report runs/bench_<N>`` re-renders a saved
run's report.  The sections are described in :mod:`opsched.benchmarks.sections`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.benchmarks import sections
from opsched.benchmarks.report import write_figures, write_report
from opsched.cache import onnx_dir, profiles_dir
from opsched.errors import OpschedError

SECTIONS = ("real", "keras", "sim", "costs", "fidelity", "ort")
RUNNERS = {"real": sections.section_real, "keras": sections.section_keras, "sim": sections.section_sim,
           "costs": sections.section_costs, "fidelity": sections.section_fidelity, "ort": sections.section_ort}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="opsched bench", description=H.doc_summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer models, batch 1, few repeats")
    ap.add_argument("--out", default="runs", help="folder that receives bench_<N>/ (default: runs)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--models", default="", help="zoo models for sections 1 and 4 (default: all; quick: "
                    + ",".join(sections.QUICK_MODELS) + ")")
    ap.add_argument("--batches", default="", help="batch sizes for section 1 (default 1,8; quick: 1)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved timing rounds (default 7; quick 3)")
    ap.add_argument("--iters", type=int, default=0, help="calls per configuration per round (default 3; quick 2)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed calls per configuration (default 3; quick 2)")
    ap.add_argument("--policy", default="", help="exported learned policy folder (default: the shipped one "
                    "or the newest <out>/*/policy/; 'none' to leave it out)")
    ap.add_argument("--search-trials", type=int, default=0, help="Optuna search budget per graph (default 100; quick 20)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out of section 1")
    ap.add_argument("--init-timeout", type=float, default=0, help="seconds a configuration may take to prepare "
                    "(compile, export) before it is skipped (default 300; quick 150)")
    ap.add_argument("--fidelity-plans", type=int, default=0, help="fresh plans per model in section 4 (default 24; "
                    "quick 20; at least 20)")
    ap.add_argument("--profiles", default=str(profiles_dir()), help="the profile cache opsched plans with "
                    "(default: the per-user cache, `opsched cache --path`)")
    ap.add_argument("--profile", action="store_true", help="first run `opsched profile` on the zoo models that "
                    "have no cached profile or runtime measurements (the fitted planning model)")
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
    args.fidelity_plans = args.fidelity_plans or (20 if q else 24)
    if args.fidelity_plans < 20:
        ap.error("--fidelity-plans must be at least 20")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()] if args.batches else ([1] if q else [1, 8])
    try:
        sections.zoo_models(args)  # an unknown --models name stops here, before a run folder exists
    except OpschedError as exc:
        ap.error(str(exc))
    return args


def find_learned_policy(spec: str, runs: Path) -> tuple[Any, str]:
    """``(policy or None, where it came from or why there is none)``: ``spec``, else the
    shipped pretrained policy, else the newest exported one under ``runs``."""
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    if spec == "none":
        return None, "left out (--policy none)"
    if spec:
        candidates = [Path(spec)]
    else:
        found = sorted(runs.glob("*/policy/policy.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        candidates = [pretrained_path(), *(p.parent for p in found)]
    reasons = []
    for c in candidates:
        if not (c / "policy.json").is_file():
            reasons.append(f"{c}: no policy.json")
            continue
        try:
            return load(c), str(c)
        except Exception as exc:
            reasons.append(f"{c}: {type(exc).__name__}: {exc}")
    return None, "no usable exported learned policy: " + "; ".join(reasons)


def profile_missing(models: list[str], batches: list[int], ctx: dict[str, Any], out: Path) -> dict[str, str]:
    """``--profile``: ``opsched profile`` (the ops, then the measured plans the runtime
    model is fitted on) for each (model, batch) without a cached profile or runtime
    measurements, each in its own process."""
    from opsched.backends.runtime_fit import record_path
    from opsched.engine.profiles import cache_path
    from opsched.machine import Machine
    from opsched.specs import load_graph

    machine, profiles, notes = Machine.probe(), ctx["profiles"], {}
    for m in models:
        for b in sorted(set(batches) | {1}):
            with sections._quiet():
                graph = load_graph(f"zoo:{m}", b)
            if cache_path(graph, machine, profiles).is_file() and record_path(graph, machine, "torch-cpu",
                                                                              profiles).is_file():
                notes[f"{m} b{b}"] = "already profiled"
                continue
            rc, tail = H.run_module("opsched", ["profile", f"zoo:{m}", "--batch", str(b), "--out", str(profiles),
                                                "--no-progress"], timeout=1800,
                                    log_path=out / "sub" / f"profile_{m}_b{b}.log", env=ctx["env"])
            notes[f"{m} b{b}"] = "profiled" if rc == 0 else f"failed ({rc}): {tail}"
    return notes


def setup(args: argparse.Namespace, out: Path, log: Any, console: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The context every section reads, and what the report says about it."""
    from opsched.machine import Machine
    from opsched.planning import describe, planning_model

    ctx: dict[str, Any] = {"env": H.worker_env(), "log": log, "onnx_dir": onnx_dir(),
                           "profiles": Path(args.profiles), "machine": Machine.probe().cpu_only(),
                           "machine_file": out / "sub" / "machine_probe.json"}
    ctx["onnx_dir"].mkdir(parents=True, exist_ok=True)
    ctx["machine_file"].parent.mkdir(parents=True, exist_ok=True)
    ctx["machine_file"].write_text(json.dumps(ctx["machine"].to_dict()))
    notes: dict[str, Any] = {}
    if args.profile:
        console.print("profiling zoo models without a cached profile ...")
        notes["profiling"] = profile_missing(sections.zoo_models(args), args.batches, ctx, out)
    ctx["model"] = planning_model(ctx["machine"], "torch-cpu", "auto", ctx["profiles"])
    ctx["model_note"] = describe(ctx["model"])
    hint = f"; no usable profile in {args.profiles}: run `opsched profile` or pass --profile"
    ctx["learned"], ctx["learned_where"] = find_learned_policy(args.policy, Path(args.out))
    notes.update(performance_model=ctx["model_note"] + (hint if ctx["model"].name == "analytic" else ""),
                 learned=ctx["learned_where"])
    return ctx, notes


def main(argv: list[str] | None = None, command: str | None = None) -> Path:
    """Run the selected sections; return the run folder.  ``command`` is the
    command line recorded in the report (default: this module's)."""
    from rich.console import Console
    from threadpoolctl import threadpool_limits

    from opsched.io import atomic_write_text, next_run_dir
    from opsched.timing import loadavg

    args = parse_args(argv)
    console = Console(stderr=True)
    out = next_run_dir(args.out, "bench")
    raw = list(sys.argv[1:] if argv is None else argv)
    command = command or shlex.join(["python", "-m", "opsched.benchmarks.run_all", *raw])
    atomic_write_text(out / "command.txt", command + "\n")
    t_start = time.perf_counter()
    desc, versions = H.machine_description(), H.package_versions()
    atomic_write_text(out / "machine.json", json.dumps(desc, indent=1))
    atomic_write_text(out / "versions.json", json.dumps(versions, indent=1))
    results: dict[str, Any] = {"command": command, "quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "machine": desc, "versions": versions, "settings": vars(args), "sections": {}}

    def save() -> None:
        results["elapsed_s"] = time.perf_counter() - t_start
        results["loadavg_end"] = loadavg()
        atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str))
        write_report(out, results)

    # The driver only plans and reports (workers measure, with their own environment):
    # its BLAS / OpenMP pools at one thread keep decision times comparable to
    # plan_speed's and out of the workers' way.
    with open(out / "errors.log", "w") as log, threadpool_limits(1):
        ctx, notes = setup(args, out, log, console)
        results.update(notes)
        with H.progress_bar(console, disable=args.no_progress) as bar:
            for key in args.sections:
                try:
                    sec = RUNNERS[key](args, ctx, out, bar)
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
    console.print(f"[bold green]report:[/bold green] {out / 'report.md'} ({(time.perf_counter() - t_start) / 60:.1f} min)")
    return out


if __name__ == "__main__":
    main()
