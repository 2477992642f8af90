"""Keras training steps (issue 22): TensorFlow's own settings, a sweep, and what ``opsched.train_step`` runs.

For each ``keras.applications`` model (``weights=None``, ``--side`` px, batch ``--batch``, sparse
categorical cross-entropy on random labels, SGD with momentum) the same captured step
(:func:`opsched.importers.tf_step.capture_keras_step`) is timed

* at TensorFlow's default (``inter=0, intra=0``: TF picks) and at the recommended setting (intra =
  physical cores per socket, inter = sockets, as TensorFlow's performance guide says);
* at every ``(inter, intra)`` of the sweep (``--levels`` squared), TensorFlow's own order;
* as ``opsched.train_step`` runs it with the shipped policy (``None``) and with critical-path-first
  (the measured choice included: its candidates are timed at apply time, apart from these rounds);
* as Keras runs it in this process (its ``tf.function`` at this process's default threads: a check
  that the worker's plain run is what Keras does).

Every setting runs in its own TensorFlow worker process (TF sizes its pools once per process);
every call is one training step timed inside the process that runs it, on a scratch copy of the
state.  Interleaved rounds after warm-up, medians, the load of other processes per round.  Peak RSS
per configuration is measured afterwards in a *fresh* worker per configuration (``VmHWM`` after a
few steps: the graph, the state and the step's activations, nothing else), plus the ``VmHWM`` of the
worker that was timed (shared by the configurations of one setting).  The cost of copying the
trained state back into the Keras model (``step.sync()``) is measured too.

    python -m opsched.benchmarks.keras_train                 # writes runs/bench/keras_train.{json,md}
    python -m opsched.benchmarks.keras_train --quick         # MobileNetV2 at 64 px, 3 rounds (smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import geomean, host_record, interleave, loadavg

MODELS = ("MobileNetV2", "NASNetMobile", "InceptionV3")
#: issue 22's targets: geometric means over the models
TARGET_VS_RECOMMENDED, TARGET_VS_DEFAULT, TARGET_BEHIND_BEST = 1.8, 1.1, 1.05


def _label(inter: int, intra: int) -> str:
    return f"sweep inter={inter},intra={intra}"


def bench_model(name: str, args: Any, machine: Any, console: Any) -> dict[str, Any]:
    """Everything measured for one model (see the module docstring)."""
    import opsched
    from opsched.adapters.base import ScheduleFallbackWarning
    from opsched.adapters.keras_train import keras_application_step
    from opsched.backends.tf_cpu import TFBackend, TFSettings, tf_default, tf_recommended
    from opsched.backends.tf_train import peak_rss_bytes, plan_args
    from opsched.importers.tf_step import capture_keras_step
    from opsched.phases import phase_counts

    spec = f"keras:{name}:side={args.side}"
    net, x, y = keras_application_step(spec, args.batch, seed=args.seed)
    feeds = [x, y]
    t0 = time.perf_counter()
    cap = capture_keras_step(net.model, net.loss, net.optimizer, x, y, name=name)
    capture_s = time.perf_counter() - t0
    graph = cap.graph
    console.print(f"{name}: {len(graph.ops)} ops ({graph.meta['step'].get('ops_before_grouping', len(graph.ops))} "
                  f"before grouping), state {cap.source.state_bytes / 1e6:.1f} MB, captured in {capture_s:.1f} s")
    be = TFBackend(machine, timeout_s=1800, startup_timeout_s=600)
    row: dict[str, Any] = {"model": name, "input": [args.batch, args.side, args.side, 3], "ops": len(graph.ops),
                           "tf_nodes": graph.meta["tf_nodes"], "phases": phase_counts(graph),
                           "gflops": graph.total_flops / 1e9, "width": graph.width(),
                           "state_mb": cap.source.state_bytes / 1e6, "capture_s": capture_s}
    try:
        settings: dict[str, TFSettings] = {"tf-default": tf_default(), "tf-recommended": tf_recommended(machine)}
        for i in args.levels:
            for j in args.levels:
                settings[_label(i, j)] = TFSettings(i, j)
        steps: dict[str, Any] = {}
        for key, pol in (("opsched (shipped policy)", None), ("opsched (critical-path-first)", "critical-path-first")):
            # the same model and optimizer: the same GraphDef, loaded once per worker (timing trains
            # each worker's scratch state, never the model)
            t1 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ScheduleFallbackWarning)
                st = opsched.train_step(pol, net.model, net.loss, net.optimizer, x, y, backend=be,
                                        measure=args.measure)
            apply_s = time.perf_counter() - t1
            meta = st.plan.meta if st.plan is not None else {}
            steps[key] = st
            same = st.graph is None or st.graph.source.graph_def == cap.source.graph_def
            row.setdefault("opsched", {})[key] = {"same_graph_def": same,
                "apply_s": apply_s, "plan_s": st.plan_s, "scheduled": st.scheduled,
                "fallback": st.fallback_reason, "warnings": [str(w.message) for w in caught],
                "chosen": meta.get("chosen"), "model_choice": meta.get("model_choice"),
                "measured_at_apply_s": meta.get("measured"),
                "settings": (plan_args(be, st.graph, st.plan).settings.label
                             if st.scheduled and st.graph is not None else None)}
            console.print(f"  {key}: {'scheduled' if st.scheduled else 'FALLBACK ' + str(st.fallback_reason)}"
                          f", chosen {meta.get('chosen')}, apply {apply_s:.0f} s")

        def worker_timer(s: TFSettings) -> Any:
            return lambda: float(be.measure(graph, s, repeats=1, warmup=0, inputs=feeds)[0])

        timers: dict[str, Any] = {k: worker_timer(s) for k, s in settings.items()}
        for key, st in steps.items():
            if st.scheduled:
                timers[key] = (lambda st=st: float(be.time_plan(st.graph, st.plan, repeats=1, warmup=0,
                                                                inputs=feeds)[0]))
        fn = cap.function

        def keras_main() -> float:
            t = time.perf_counter()
            fn(x, y)
            return time.perf_counter() - t

        timers["keras tf.function (this process)"] = keras_main
        for t in timers.values():  # every worker started and its copy built before the rounds
            t()
        timings = interleave(timers, warmup=args.warmup, repeats=args.rounds, pids=be.worker_pids())
        med = {k: timings.median(k) for k in timers}
        row["median_s"] = med
        row["stats_s"] = {k: timings.stats(k) for k in timers}
        row["load"] = timings.load_record()
        row["load_warning"] = timings.warning()
        sweep = [k for k in settings if k.startswith("sweep ")]
        best = min(sweep, key=med.__getitem__)
        row["best_sweep"], row["best_sweep_s"] = best, med[best]
        for key in steps:
            if key in med:
                r = row["opsched"][key]
                r["median_s"] = med[key]
                r["vs_recommended"] = med["tf-recommended"] / med[key]
                r["vs_default"] = med["tf-default"] / med[key]
                r["vs_best_sweep"] = med[best] / med[key]
        # peak RSS: the timed workers (shared per setting), then a fresh worker per configuration
        rss_timed = {}
        for k, s in settings.items():
            pid = be.worker_pid(s)
            rss_timed[k] = peak_rss_bytes(pid)
        for key, st in steps.items():
            if st.scheduled:
                rss_timed[key] = peak_rss_bytes(be.worker_pid(plan_args(be, st.graph, st.plan).settings))
        row["peak_rss_timed_worker_mb"] = {k: (v / 2**20 if v else None) for k, v in rss_timed.items()}
        # the sync rule's cost: one step, then copy the trained state back into the Keras model
        st = next((s for s in steps.values() if s.scheduled), None)
        if st is not None:
            t2 = time.perf_counter()
            st(x, y)
            call_s = time.perf_counter() - t2
            sync_s = st.sync()
            row["sync"] = {**st.sync_stats, "step_call_s": call_s, "sync_s": sync_s,
                           "written_mb": st.sync_stats["pull_bytes"] / 1e6}
            for s in steps.values():
                s.close()
    finally:
        be.close()
    if args.memory:
        row["peak_rss_fresh_mb"] = _fresh_rss(graph, feeds, settings, steps, machine)
    return row


def _fresh_rss(graph: Any, feeds: list, settings: dict, steps: dict, machine: Any) -> dict[str, float | None]:
    """Peak RSS (MiB) of a fresh worker after a few steps of each configuration, one at a time."""
    from opsched.backends.tf_cpu import TFBackend
    from opsched.backends.tf_train import peak_rss_bytes

    out: dict[str, float | None] = {}
    jobs: list[tuple[str, Any]] = [(k, ("settings", s)) for k, s in settings.items()]
    jobs += [(k, ("plan", st.plan)) for k, st in steps.items() if st.scheduled]
    for key, (kind, what) in jobs:
        be = TFBackend(machine, timeout_s=1800, startup_timeout_s=600)
        try:
            if kind == "settings":
                be.measure(graph, what, repeats=3, warmup=1, inputs=feeds)
                pid = be.worker_pid(what)
            else:
                be.time_plan(graph, what, repeats=3, warmup=1, inputs=feeds)
                pid = be.worker_pids()[0]
            v = peak_rss_bytes(pid)
            out[key] = v / 2**20 if v else None
        finally:
            be.close()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.keras_train", description=H.doc_summary(__doc__))
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated keras.applications names")
    ap.add_argument("--side", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--levels", default="1,2", help="thread levels of the sweep (inter x intra)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--measure", type=int, default=3, help="opsched.train_step's measure (candidates timed)")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the fresh-worker RSS runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(H.DEFAULT_OUT))
    ap.add_argument("--quick", action="store_true", help="MobileNetV2 at 64 px, 3 rounds, no fresh RSS runs")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if args.quick:
        args.models, args.side, args.rounds, args.memory = "MobileNetV2", 64, 3, False
    args.levels = [int(v) for v in str(args.levels).split(",") if v.strip()]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from rich.console import Console

    from opsched.backends.tf_cpu import tf_default, tf_recommended
    from opsched.machine import Machine

    console = Console(stderr=True)
    machine = Machine.probe().cpu_only()
    host = host_record()
    t_start = time.perf_counter()
    rows = [bench_model(m.strip(), args, machine, console) for m in args.models.split(",") if m.strip()]
    summary: dict[str, Any] = {}
    for key in ("opsched (shipped policy)", "opsched (critical-path-first)"):
        ok = [r["opsched"][key] for r in rows if "median_s" in r["opsched"][key]]
        if len(ok) == len(rows):
            summary[key] = {
                "vs_recommended": geomean(o["vs_recommended"] for o in ok),
                "vs_default": geomean(o["vs_default"] for o in ok),
                "vs_best_sweep": geomean(o["vs_best_sweep"] for o in ok),
            }
            s = summary[key]
            s["meets"] = {"vs_recommended >= 1.8": s["vs_recommended"] >= TARGET_VS_RECOMMENDED,
                          "vs_default >= 1.1": s["vs_default"] >= TARGET_VS_DEFAULT,
                          "within 5% of the best sweep setting": s["vs_best_sweep"] >= 1 / TARGET_BEHIND_BEST}
        else:
            summary[key] = {"missing": [r["model"] for r in rows if "median_s" not in r["opsched"][key]]}
    report = {
        "benchmark": "keras_train",
        "command": " ".join(["python -m opsched.benchmarks.keras_train", *raw]),
        "machine": machine.to_dict(), "host": host, "tf_version": tf.__version__,
        "tf_default": tf_default().label, "tf_recommended": tf_recommended(machine).label,
        "levels": args.levels, "rounds": args.rounds, "warmup": args.warmup, "measure": args.measure,
        "seed": args.seed, "loadavg_start": host["loadavg"], "loadavg_end": loadavg(),
        "elapsed_s": time.perf_counter() - t_start, "summary": summary, "models": rows,
        "targets": {"vs_recommended": TARGET_VS_RECOMMENDED, "vs_default": TARGET_VS_DEFAULT,
                    "behind_best_sweep": TARGET_BEHIND_BEST},
    }
    md = _markdown(report)
    H.save_result(Path(args.out), "keras_train", report, md)
    console.print(md)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _markdown(r: dict[str, Any]) -> str:
    cols = ["tf-default", "tf-recommended"] + [k for k in r["models"][0]["median_s"] if k.startswith("sweep ")]
    cols += ["opsched (shipped policy)", "opsched (critical-path-first)", "keras tf.function (this process)"]
    short = {k: k.replace("sweep ", "").replace("inter=", "i").replace("intra=", "j").replace("opsched ", "")
             for k in cols}
    lines = [
        "# Keras training steps: TensorFlow's settings, a sweep, and opsched.train_step",
        "",
        f"`{r['command']}` - TF {r['tf_version']}, {r['machine']['devices'][0]['cores']} cores, load average "
        f"{r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}, {r['elapsed_s']:.0f} s. "
        f"tf-default = {r['tf_default']}, tf-recommended = {r['tf_recommended']}.",
        "",
        f"Median ms per training step ({r['rounds']} interleaved rounds after {r['warmup']} warm-up calls; "
        "each setting in its own TensorFlow worker, timed inside it; SGD momentum, batch "
        f"{r['models'][0]['input'][0]}).",
        "",
        "| model | ops | " + " | ".join(short[k] for k in cols) + " | best sweep | others' cores |",
        "|" + "---|" * (4 + len(cols)),
    ]
    for m in r["models"]:
        med = m["median_s"]
        lines.append(f"| {m['model']} {m['input'][1]}px | {m['ops']} | " + " | ".join(_ms(med.get(k)) for k in cols)
                     + f" | {short[m['best_sweep']]} | {m['load']['others_cores_median']:.2f} |")
    lines += ["", "| model | opsched row | chosen plan | settings | vs recommended | vs default | vs best sweep "
              "| apply s |", "|---|---|---|---|---|---|---|---|"]
    for m in r["models"]:
        for key, o in m["opsched"].items():
            if "median_s" not in o:
                lines.append(f"| {m['model']} | {key} | fallback: {o['fallback']} | | | | | {o['apply_s']:.0f} |")
                continue
            lines.append(f"| {m['model']} | {key} | {o['chosen']} | {o['settings']} | {o['vs_recommended']:.2f}x | "
                         f"{o['vs_default']:.2f}x | {o['vs_best_sweep']:.2f}x | {o['apply_s']:.0f} |")
    lines += ["", "Geometric means over the models (targets: >= 1.8x over recommended, >= 1.1x over default, "
              "no more than 5% behind the best sweep setting):", ""]
    for key, s in r["summary"].items():
        if "missing" in s:
            lines.append(f"- {key}: fell back on {', '.join(s['missing'])}")
        else:
            lines.append(f"- {key}: {s['vs_recommended']:.2f}x over recommended, {s['vs_default']:.2f}x over "
                         f"default, {s['vs_best_sweep']:.2f}x of the best sweep setting; meets: "
                         + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in s["meets"].items()))
    lines += ["", "Peak RSS (MiB) per configuration, a fresh worker each (after 1 + 3 steps):", "",
              "| model | " + " | ".join(short[k] for k in cols[:-1]) + " |", "|" + "---|" * len(cols)]
    for m in r["models"]:
        rss = m.get("peak_rss_fresh_mb") or {}
        lines.append(f"| {m['model']} | " + " | ".join("-" if rss.get(k) is None else f"{rss[k]:.0f}"
                                                     for k in cols[:-1]) + " |")
    lines += ["", "Copying the trained state back into the Keras model (`step.sync()`, the written variables):", ""]
    for m in r["models"]:
        s = m.get("sync")
        if s:
            lines.append(f"- {m['model']}: {s['written_mb']:.1f} MB in {s['sync_s'] * 1e3:.0f} ms (one scheduled "
                         f"call, IPC included: {s['step_call_s'] * 1e3:.0f} ms; first push {s['push_s'] * 1e3:.0f} ms)")
    warn = [f"{m['model']}: {m['load_warning']}" for m in r["models"] if m.get("load_warning")]
    if warn:
        lines += ["", "Load: " + " ".join(warn)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
