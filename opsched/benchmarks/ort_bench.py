"""The ``ort`` backend's benchmark: opsched's plans on ONNX Runtime against ONNX Runtime itself.

Three sections, each a function returning JSON-ready rows (``bench/ort_bench.py``
runs them and writes ``runs/bench/ort_bench.{json,md}``):

* :func:`zoo_ratios` - for each zoo model at each batch, what ``opsched apply
  --backend ort`` runs (the default policy's plan, or opsched's lane plan, or
  one session - whichever the planning model predicts fastest,
  :func:`opsched.adapters.onnx.plan_for_ort`) against ONNX Runtime's
  sequential execution at its default threads, in interleaved rounds in one
  process, both timed the same way (wall clock around one call, numpy inputs
  in, numpy outputs out, each call after a pause that lets the other's
  spinning intra-op threads stop, :func:`opsched.timing.settle`); the ratio is the median over rounds of
  ``sequential / opsched`` (> 1: opsched faster), with quartiles.  Outputs
  are checked first.
* :func:`sim_to_real` - the planning model (profiles and the runtime model
  ``opsched profile --backend ort`` fitted) against fresh plans measured here:
  the calibration's plan families drawn with another seed and opsched's lane
  plans, none equal to a plan the runtime model was fitted on.
* :func:`apply_seconds` - the wall time of the ``opsched apply --backend ort``
  command on a zoo model in a fresh process, the ONNX export included (the
  cached export is moved aside first).

Every section records the load it ran under (:mod:`opsched.timing`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from opsched.benchmarks.harness import doc_summary

if TYPE_CHECKING:
    from opsched.engine.contracts import PerfModel
    from opsched.graph import OpGraph
    from opsched.machine import Machine
    from opsched.plan import Plan
    from opsched.policies import Policy

ZOO_MODELS = ("inception", "resnet50", "nasnet", "randwire", "lstm", "transformer")


def _say(progress: Callable[[str], None] | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


def wait_quiet(max_wait_s: float, limit: float = 0.3, window_s: float = 3.0,
               progress: Callable[[str], None] | None = None) -> float:
    """Wait (at most ``max_wait_s``) until other processes use at most ``limit``
    cores over two windows in a row; returns their cores in the last window."""
    from opsched.timing import wait_quiet as wait

    return wait(max_wait_s, limit, window_s, windows=2, on_wait=lambda others: _say(
        progress, f"waiting for a quiet machine: other processes use {others:.2f} cores"))


# ------------------------------------------------------------------ ratios
def zoo_ratios(models: Sequence[str] = ZOO_MODELS, batches: Sequence[int] = (1, 8), *, rounds: int = 15,
               warmup: int = 3, policy: Policy | str | Path | None = None,
               cache_dir: str | Path | None = None,
               quiet_wait_s: float = 0.0, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Per (model, batch): opsched on ``ort`` vs ONNX Runtime sequential (see the module docstring)."""
    from opsched.adapters.onnx import ORT_ATOL, ORT_RTOL, reference_session, remember, run_reference
    from opsched.backends.ort_backend import OrtBackend
    from opsched.backends.ort_lower import describe
    from opsched.backends.sim import SimBackend
    from opsched.machine import Machine
    from opsched.planning import describe as describe_model
    from opsched.planning import planning_model
    from opsched.scheduled import ScheduleFallbackWarning, apply, outputs_equal
    from opsched.specs import load_model, onnx_graph_of
    from opsched.timing import interleave, wall_clock

    machine = Machine.probe().cpu_only()
    rows = []
    for name in models:
        for batch in batches:
            _say(progress, f"{name} batch {batch}")
            loaded = load_model(f"zoo:{name}", batch)
            assert loaded.inputs is not None  # a zoo network comes with its example inputs
            graph = onnx_graph_of(loaded)
            model = planning_model(machine, "ort", "auto", cache_dir)
            with OrtBackend(machine, model=model) as be, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ScheduleFallbackWarning)
                remember(loaded.model, loaded.inputs, graph, batch)
                sm = apply(policy, loaded.model, loaded.inputs, backend=be, perf_model=model, batch=batch)
                row: dict[str, Any] = {"model": name, "batch": batch, "n_ops": len(graph.ops),
                                       "perf_model": describe_model(model)}
                if not sm.scheduled:
                    row["error"] = sm.fallback_reason or "; ".join(str(w.message) for w in caught)
                    rows.append(row)
                    continue
                plan = sm.plan
                assert plan is not None  # scheduled: it runs its plan
                seq = reference_session(graph)
                src = graph.source
                if quiet_wait_s > 0:
                    wait_quiet(quiet_wait_s, progress=progress)
                feeds = dict(zip(src.inputs, src.example_inputs, strict=True))
                names = list(src.outputs)
                same = outputs_equal(be.execute(graph, plan, src.example_inputs),
                                     run_reference(seq, graph, src.example_inputs), ORT_RTOL, ORT_ATOL)
                t = interleave({"ort-sequential": wall_clock(lambda seq=seq, feeds=feeds, names=names:
                                                             seq.run(names, feeds)),
                                "opsched": wall_clock(lambda plan=plan, graph=graph, be=be,
                                                      x=src.example_inputs: be.execute(graph, plan, x))},
                               warmup, rounds)  # each timed call after the previous one's threads went quiet
                inv = [a / b for a, b in zip(t.samples["ort-sequential"], t.samples["opsched"], strict=True)]
                q1, med, q3 = (float(x) for x in np.percentile(inv, [25, 50, 75]))
                sim = SimBackend(machine, model=model)
                row.update({
                    "ort_sequential_ms": t.median("ort-sequential") * 1e3, "opsched_ms": t.median("opsched") * 1e3,
                    "ratio": med, "ratio_q1": q1, "ratio_q3": q3, "outputs_equal": bool(same),
                    "plan": plan.policy, "instead_of": plan.meta.get("instead_of"), "order": plan.meta.get("order"),
                    "order_measured_s": plan.meta.get("measured_s"), "plan_s": sm.plan_s,
                    "lowering": describe(be.compile(graph, plan).lowering),
                    "predicted_ms": sim.run(graph, plan).makespan * 1e3,
                    "load": t.load_record(), "rounds": rounds})
                rows.append(row)
    return rows


# ------------------------------------------------------------------ sim to real
def fresh_plans(graph: OpGraph, machine: Machine, model: PerfModel, fitted: Sequence[Plan], seed: int = 1,
                n_plans: int = 16) -> dict[str, Plan]:
    """Plans of ``graph`` the runtime model was not fitted on: the calibration's plan
    families drawn with another seed, and opsched's lane plans, minus any plan whose
    assignments equal one in ``fitted``."""
    from opsched.backends.ort_fit import ort_plans
    from opsched.policies.ort_lanes import LanePlanner

    plans = dict(ort_plans(graph, machine, model, n_plans, seed))
    plans.update({f"lanes-{k}": p for k, p in LanePlanner().candidates(graph, machine, model).items()})
    seen = [p.assignments for p in fitted]
    out: dict[str, Plan] = {}
    for name, p in plans.items():
        if all(p.assignments != a for a in seen):
            out[name] = p
            seen.append(p.assignments)
    return out


def sim_to_real(models: Sequence[str] = ZOO_MODELS, batches: Sequence[int] = (1,), *, rounds: int = 3,
                cache_dir: str | Path | None = None, quiet_wait_s: float = 0.0,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Simulated (the planning model ``opsched apply`` uses) vs measured wall time of
    plans the runtime model was not fitted on (:func:`fresh_plans`), per model and pooled."""
    from opsched.backends.ort_fit import measure_plans, wall_time
    from opsched.backends.runtime_fit import load_runs, scores
    from opsched.machine import Machine
    from opsched.planning import default_cache_dir, describe, planning_model
    from opsched.specs import load_onnx_graph

    machine = Machine.probe().cpu_only()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model = planning_model(machine, "ort", "auto", cache)
    if model.runtime is None:
        return {"error": f"no fitted ort runtime model in {cache}; run `opsched profile zoo:NAME --backend ort` "
                         "first"}
    fitted = {r.graph.fingerprint(): list(r.plans.values()) for r in load_runs(machine, model, "ort", cache)}
    per_model, sims_all, real_all, rows = [], [], [], []
    for name in models:
        for batch in batches:
            graph = load_onnx_graph(f"zoo:{name}", batch)
            plans = fresh_plans(graph, machine, model, fitted.get(graph.fingerprint(), []))
            _say(progress, f"sim-to-real: {name} batch {batch}, {len(plans)} plans not fitted on")
            if quiet_wait_s > 0:
                wait_quiet(quiet_wait_s, progress=progress)
            meas = measure_plans(graph, plans, machine, model, rounds=rounds)
            sims = {p: wall_time(graph, machine, model, plan) for p, plan in plans.items()}
            real = {p: float(np.median(meas["walls"][p])) for p in plans}
            s, m = [sims[p] for p in plans], [real[p] for p in plans]
            per_model.append({"graph": name, "batch": batch, "n_ops": len(graph.ops), **scores(s, m),
                              "others_cores": float(np.median([x for p in plans for x in meas["others"][p]]))})
            sims_all += s
            real_all += m
            rows += [{"graph": name, "batch": batch, "plan": p, "sim_ms": sims[p] * 1e3, "real_ms": real[p] * 1e3}
                     for p in plans]
    return {"pooled": scores(sims_all, real_all), "per_model": per_model, "plans": rows,
            "planning_model": describe(model), "runtime": model.runtime.to_dict(),
            "unseen_plans": "plans drawn with another seed than the calibration's, none equal to a plan it was fitted on"}


# ------------------------------------------------------------------ apply time
def apply_seconds(model: str = "inception", batch: int = 1, *, cwd: str | Path = ".", repeats: int = 10,
                  timeout: float = 300.0) -> dict[str, Any]:
    """Wall seconds of ``opsched apply --backend ort --model zoo:<model>`` in a fresh
    process, its ONNX export included (a cached export is moved aside and restored)."""
    from opsched.cache import onnx_dir
    from opsched.specs import load_model, onnx_export_key

    loaded = load_model(f"zoo:{model}", batch)
    cached = onnx_dir() / f"{loaded.name}_{onnx_export_key(loaded)}.onnx"
    with tempfile.TemporaryDirectory(prefix="opsched-ortbench-") as tmp:
        aside = Path(tmp) / cached.name
        if cached.is_file():
            shutil.move(str(cached), aside)
        js = Path(tmp) / "apply.json"
        cmd = [sys.executable, "-m", "opsched", "apply", "--backend", "ort", "--model", f"zoo:{model}", "--batch",
               str(batch), "--repeats", str(repeats), "--no-progress", "--out", tmp, "--json", str(js)]
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - t0
        if aside.is_file() and not cached.is_file():
            shutil.move(str(aside), cached)
        out: dict[str, Any] = {"model": model, "batch": batch, "seconds": seconds, "rc": proc.returncode,
                               "command": "opsched " + " ".join(cmd[3:]), "loadavg_start": load0,
                               "loadavg_end": os.getloadavg(), "export_included": True}
        if js.is_file():
            data = json.loads(js.read_text())
            out["rows"] = [{k: r[k] for k in ("config", "median_s", "outputs_equal_eager", "plan")} for r in data["rows"]]
        else:
            out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return out


# ------------------------------------------------------------------ report
def markdown(result: dict[str, Any]) -> str:
    """The benchmark as a markdown report."""
    lines = ["# opsched on ONNX Runtime (`ort` backend)", "", f"`{result.get('command', '')}` on "
             f"{result.get('host', {}).get('cpu_model', '?')} ({result.get('host', {}).get('usable_cpus', '?')} CPUs); "
             f"load average {result.get('loadavg_start')} at start, {result.get('loadavg_end')} at end.", ""]
    rows = result.get("ratios")
    if rows:
        lines += ["## Time per inference: ONNX Runtime sequential (default threads) / opsched on `ort`", "",
                  "Median over interleaved rounds of the per-round ratio (> 1: opsched faster), quartiles in "
                  "brackets; `plan` is what ran (`ort-single`: ONNX Runtime's own session of the whole model - "
                  "the planning model predicted no lowered plan faster by the choice margin); `others' cores`: "
                  "what other processes used during the rounds (median).", "",
                  "| model | batch | ORT seq ms | opsched ms | ratio | plan | segments / lanes | outputs | "
                  "others' cores |", "|---|---:|---:|---:|---:|---|---|---|---:|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['batch']} | - | - | - | error: {r['error'][:80]} | | | |")
                continue
            low = r["lowering"]
            plan = r["plan"] + (f" ({r['order']} order)" if r.get("order") else "")
            lines.append(f"| {r['model']} | {r['batch']} | {r['ort_sequential_ms']:.2f} | {r['opsched_ms']:.2f} | "
                         f"**{r['ratio']:.2f}** ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) | {plan} | "
                         f"{low['segments']} / {low['lanes']} | {'equal' if r['outputs_equal'] else 'DIFFER'} | "
                         f"{r['load']['others_cores_median']:.2f} |")
        for b in sorted({r["batch"] for r in rows}):
            vals = [r["ratio"] for r in rows if r["batch"] == b and "ratio" in r]
            if vals:
                lines.append(f"\nGeometric mean at batch {b}: **{float(np.exp(np.mean(np.log(vals)))):.3f}** "
                             f"over {len(vals)} models; lowest {min(vals):.2f}.")
    s2r = result.get("sim_to_real")
    if s2r and "pooled" in s2r:
        p = s2r["pooled"]
        lines += ["", "## Sim-to-real on plans the runtime model was not fitted on", "",
                  f"Pooled over {p['plans']} plans: median error **{p['mdape']:.1%}**, Spearman **{p['spearman']:.2f}**,"
                  f" within 15%: {p['within_15']:.0%}, median sim/real {p['median_ratio']:.2f}.", "",
                  "| graph | batch | plans | median error | Spearman | within 15% |", "|---|---:|---:|---:|---:|---:|"]
        for r in s2r["per_model"]:
            lines.append(f"| {r['graph']} | {r.get('batch', '')} | {r['plans']} | {r['mdape']:.1%} | "
                         f"{r['spearman']:.2f} | {r['within_15']:.0%} |")
    elif s2r:
        lines += ["", f"Sim-to-real: {s2r.get('error')}"]
    app = result.get("apply")
    if app:
        lines += ["", "## `opsched apply --backend ort` wall time (export and session building included)", ""]
        for a in app:
            lines.append(f"- `{a['command']}`: **{a['seconds']:.1f} s** (exit {a['rc']}; load average "
                         f"{a['loadavg_start'][0]:.2f} -> {a['loadavg_end'][0]:.2f})")
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out_dir: str | Path = Path("runs") / "bench") -> tuple[Path, Path]:
    """``ort_bench.json`` and ``ort_bench.md`` in ``out_dir``."""
    from opsched.io import atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "ort_bench.json", out / "ort_bench.md"
    atomic_write_text(js, json.dumps(result, indent=1, default=str) + "\n")
    atomic_write_text(md, markdown(result))
    return js, md


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/ort_bench.py [--sections ratios,sim2real,apply] [--models ...] [--batches 1,8]``."""
    import argparse

    from opsched.timing import host_record

    ap = argparse.ArgumentParser(prog="bench/ort_bench.py", description=doc_summary(__doc__))
    ap.add_argument("--sections", default="ratios,sim2real,apply")
    ap.add_argument("--models", default=",".join(ZOO_MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--sim-batches", default="1", help="batches of the sim-to-real section")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--policy", default=None, help="policy (default: the shipped one, as opsched apply); "
                    "ort-lanes: opsched's lane planner alone (against one session)")
    ap.add_argument("--profiles", default=None, help="profile cache (default runs/profiles)")
    ap.add_argument("--out", default=str(Path("runs") / "bench"))
    ap.add_argument("--quiet-wait", type=float, default=0.0, help="before each model, wait up to this many "
                    "seconds for other processes to leave the cores (0: do not wait)")
    args = ap.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    result: dict[str, Any] = {"command": "python bench/ort_bench.py " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:]),
                              "host": host_record(), "loadavg_start": os.getloadavg()}
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    if "sim2real" in sections:
        result["sim_to_real"] = sim_to_real(models, [int(b) for b in args.sim_batches.split(",") if b.strip()],
                                            cache_dir=args.profiles, quiet_wait_s=args.quiet_wait, progress=say)
    policy: Policy | str | None = args.policy
    if policy == "ort-lanes":
        from opsched.policies.ort_lanes import LanePlanner

        policy = LanePlanner()
    if "ratios" in sections:
        result["ratios"] = zoo_ratios(models, batches, rounds=args.rounds, warmup=args.warmup, policy=policy,
                                      cache_dir=args.profiles, quiet_wait_s=args.quiet_wait, progress=say)
    if "apply" in sections:
        if args.quiet_wait > 0:
            wait_quiet(args.quiet_wait, progress=say)
        say("opsched apply --backend ort --model zoo:inception (fresh process, export included)")
        result["apply"] = [apply_seconds("inception", 1)]
    result["loadavg_end"] = os.getloadavg()
    result["elapsed_s"] = time.perf_counter() - t0
    js, md = write(result, args.out)
    say(f"wrote {js} and {md}")
    return 0


__all__ = ["ZOO_MODELS", "apply_seconds", "fresh_plans", "main", "markdown", "sim_to_real", "wait_quiet", "write",
           "zoo_ratios"]
