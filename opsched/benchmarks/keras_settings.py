"""TensorFlow thread settings for Keras application models: opsched's choice against an exhaustive sweep.

The zoo has no TensorFlow twin, so TensorFlow is judged on Keras applications
(``weights=None``, small input, batch 1): every (inter, intra) setting, TF's
default and the setting Intel's guide recommends, and the one opsched picks
from a short probe measured apart from the sweep - is it within 5% of the best?

    python -m opsched.benchmarks.keras_settings          # writes runs/bench/keras_settings.{json,md}
    python -m opsched.benchmarks.keras_settings --quick  # two models, fewer rounds (smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import opsched.benchmarks.harness as H
from opsched.timing import host_record, interleave, loadavg

MODELS = {  # name -> input side (pixels); all accept any side >= 75 when weights=None
    "MobileNetV2": 128,
    "ResNet50": 128,
    "InceptionV3": 128,
    "DenseNet121": 128,
    "NASNetMobile": 128,
    "EfficientNetB0": 128,
}


def _candidates(machine: Any) -> list[Any]:
    from opsched.backends.tf_cpu import TFSettings

    levels = machine.cpu.thread_levels()
    return [TFSettings(i, j) for i in levels for j in levels] + [TFSettings(0, 0)]


def _sim_pick(graph: Any, machine: Any, candidates: list[Any]) -> Any:
    """The candidate whose tf-settings plan the simulator (analytic model) predicts fastest."""
    from opsched.backends.sim import SimBackend
    from opsched.policies.heuristics import TFSettings as SettingsPolicy

    sim = SimBackend(machine)
    cores = machine.cpu.cores
    best, best_t = None, float("inf")
    for s in candidates:
        inter, intra = s.inter or cores, s.intra or cores

        class _Fixed(SettingsPolicy):
            name = f"tf-{s.label}"

            def settings(self, m: Any, _i: int = intra, _o: int = inter) -> tuple[int, int]:
                return _i, _o

        t = sim.run(graph, _Fixed().plan(graph, machine)).makespan
        if t < best_t:
            best, best_t = s, t
    return best


def _measure(backend: Any, graph: Any, settings: list[Any], rounds: int, iters: int, bar: Any, task: Any
             ) -> tuple[dict[str, list[float]], float]:
    """Interleaved rounds; returns samples per setting label and the median cores
    other processes (not the TensorFlow workers) used per round."""
    samples: dict[str, list[float]] = {s.label: [] for s in settings}

    def call(s: Any) -> float:
        xs = backend.measure(graph, s, repeats=iters, warmup=1)
        samples[s.label] += xs
        bar.advance(task)
        return float(np.median(xs))

    pids = [backend.worker_pid(s) for s in settings]
    timings = interleave({s.label: (lambda s=s: call(s)) for s in settings}, warmup=0, repeats=rounds, pids=pids)
    return samples, timings.load_record()["others_cores_median"]


def _ratio_ci(a: list[float], b: list[float], rng: np.random.Generator, n: int = 2000) -> list[float]:
    """90% bootstrap interval of median(a) / median(b): is a verdict outside the noise?"""
    a_, b_ = np.asarray(a), np.asarray(b)
    ra = np.median(rng.choice(a_, (n, a_.size)), axis=1)
    rb = np.median(rng.choice(b_, (n, b_.size)), axis=1)
    return [float(x) for x in np.percentile(ra / rb, [5, 95])]


def main(argv: Sequence[str] | None = None) -> None:
    """For each model:

    * **sweep** - every (inter, intra) pair over the CPU's thread levels plus
      TF's own default (0, 0), each in its own TensorFlow worker process
      (``TFBackend.measure``: plain TensorFlow with all of Grappler, TF's
      placement and order - exactly what a user gets from the two knobs);
    * **tf-default** = (0, 0); **tf-recommended** = (inter = sockets, intra =
      physical cores per socket);
    * **opsched's choice** - a *short measured probe* of the same candidates
      (``--probe-rounds`` x ``--probe-iters`` runs each), taken before the sweep
      and never reused by it, so the verdict is judged on independent
      measurements.  The table also shows the *simulator's pick* (each
      candidate's ``tf-settings`` plan simulated with the analytic model) and
      the setting ``TFBackend`` derives from a one-thread-per-op plan.

    Timing: :func:`opsched.timing.interleave` over the candidates, each call
    ``--iters`` timed inferences after one untimed one; the figure per setting
    is the median of all its samples, and the load of other processes (cores
    busy outside the TensorFlow workers) is recorded per model."""
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.keras_settings",
                                 description=H.doc_summary(__doc__))
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated tf.keras.applications names")
    ap.add_argument("--size", type=int, default=0, help="input side for every model (0: the table above)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--probe-rounds", type=int, default=3)
    ap.add_argument("--probe-iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(H.DEFAULT_OUT))
    ap.add_argument("--quick", action="store_true", help="MobileNetV2 and ResNet50, 3 rounds")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if args.quick:
        args.models, args.rounds = "MobileNetV2,ResNet50", 3
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import tensorflow as tf
    from rich.console import Console

    from opsched.backends.tf_cpu import TFBackend, tf_default, tf_recommended
    from opsched.importers.tf_graph import from_keras
    from opsched.machine import Machine
    from opsched.plan import uniform_plan
    from opsched.progress import progress_bar

    console = Console(stderr=True)
    machine = Machine.probe()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if not hasattr(tf.keras.applications, m)]
    if unknown:
        sys.exit(f"unknown tf.keras.applications model(s): {', '.join(unknown)}")
    candidates = _candidates(machine)
    labels = [s.label for s in candidates]
    default, recommended = tf_default(), tf_recommended(machine)
    boot = np.random.default_rng(args.seed)
    t_start = time.perf_counter()
    host = host_record()
    results = []
    # The benchmark measures plain TensorFlow, so Grappler runs all its passes (arithmetic too).
    backend = TFBackend(machine, arithmetic=True, timeout_s=900)
    steps = len(names) * (args.probe_rounds + args.rounds) * len(candidates)
    try:
        with progress_bar(console=console) as bar:
            task = bar.add_task("keras settings", total=steps)
            for name in names:
                side = args.size or MODELS.get(name, 128)
                bar.update(task, description=f"{name}: import")
                model = getattr(tf.keras.applications, name)(weights=None, input_shape=(side, side, 3))
                graph = from_keras(model, batch=args.batch)
                del model
                bar.update(task, description=f"{name}: probe")
                probe, _ = _measure(backend, graph, candidates, args.probe_rounds, args.probe_iters, bar, task)
                probe_med = {k: float(np.median(v)) for k, v in probe.items()}
                choice = min(candidates, key=lambda s: probe_med[s.label])
                bar.update(task, description=f"{name}: sweep")
                sweep, others = _measure(backend, graph, candidates, args.rounds, args.iters, bar, task)
                med = {k: float(np.median(v)) for k, v in sweep.items()}
                best = min(labels, key=lambda k: med[k])
                sim_choice = _sim_pick(graph, machine, candidates)
                derived = backend.settings_for(graph, uniform_plan(graph, machine, 1))
                backend.forget(graph)
                row = {
                    "model": name, "input": [args.batch, side, side, 3], "ops": len(graph.ops),
                    "gflops": graph.total_flops / 1e9, "width": graph.width(),
                    "median_s": med, "samples_s": sweep, "probe_median_s": probe_med,
                    "best": best, "best_s": med[best],
                    "opsched_choice": choice.label, "opsched_s": med[choice.label],
                    "tf_default": default.label, "tf_default_s": med[default.label],
                    "tf_recommended": recommended.label, "tf_recommended_s": med[recommended.label],
                    "speedup_vs_default": med[default.label] / med[choice.label],
                    "speedup_vs_recommended": med[recommended.label] / med[choice.label],
                    "within_5pct": med[choice.label] <= 1.05 * med[best],
                    "sim_choice": sim_choice.label, "sim_within_5pct": med[sim_choice.label] <= 1.05 * med[best],
                    "plan_derived": f"inter={derived.inter},intra={derived.intra}",
                    "others_busy_cores": others,
                }
                row["choice_over_best_ci90"] = _ratio_ci(sweep[choice.label], sweep[best], boot)
                row["plan_derived_within_5pct"] = med.get(row["plan_derived"], float("inf")) <= 1.05 * med[best]
                results.append(row)
    finally:
        backend.close()
    elapsed = time.perf_counter() - t_start
    report = {
        "benchmark": "keras_settings",
        "command": " ".join(["python -m opsched.benchmarks.keras_settings", *raw]),
        "machine": machine.to_dict(), "host": host, "tf_version": tf.__version__,
        "settings": labels, "tf_default": default.label, "tf_recommended": recommended.label,
        "opsched_choice_method": (f"measured probe: {args.probe_rounds} rounds x {args.probe_iters} runs per "
                                  "candidate, before and separate from the sweep"),
        "rounds": args.rounds, "iters": args.iters, "seed": args.seed,
        "loadavg_start": host["loadavg"], "loadavg_end": loadavg(), "elapsed_s": elapsed,
        "all_within_5pct": all(r["within_5pct"] for r in results),
        "mean_speedup_vs_default": float(np.exp(np.mean([np.log(r["speedup_vs_default"]) for r in results]))),
        "mean_speedup_vs_recommended": float(np.exp(np.mean([np.log(r["speedup_vs_recommended"])
                                                             for r in results]))),
        "models": results,
    }
    H.save_result(Path(args.out), "keras_settings", report, _markdown(report))
    console.print(_markdown(report))


def _markdown(r: dict[str, Any]) -> str:
    labels = r["settings"]
    short = {k: ("0,0 (TF)" if k == "inter=0,intra=0" else k.replace("inter=", "").replace("intra=", ""))
             for k in labels}
    lines = [
        "# TensorFlow thread settings on Keras applications",
        "",
        f"`{r['command']}` - TF {r['tf_version']}, {r['machine']['devices'][0]['cores']} cores "
        f"({r['machine']['devices'][0]['name']}), load average {r['loadavg_start'][0]:.1f} -> "
        f"{r['loadavg_end'][0]:.1f}, {r['elapsed_s']:.0f} s.",
        "",
        f"Median ms per inference ({r['rounds']} interleaved rounds x {r['iters']} runs) for each "
        "(inter, intra); tf-default = 0,0, tf-recommended = "
        f"{short[r['tf_recommended']]}. opsched's choice: {r['opsched_choice_method']}.",
        "",
        "| model | GFLOPs | ops | width | " + " | ".join(short[k] for k in labels)
        + " | best | opsched | vs default | vs recommended | within 5% (90% CI of ratio) | sim pick"
        " | others' cores |",
        "|" + "---|" * (4 + len(labels) + 7),
    ]
    for m in r["models"]:
        cells = []
        for k in labels:
            v = f"{m['median_s'][k] * 1e3:.2f}"
            cells.append(f"**{v}**" if k == m["best"] else v)
        lines.append(
            f"| {m['model']} {m['input'][1]}px | {m['gflops']:.2f} | {m['ops']} | {m['width']} | "
            + " | ".join(cells)
            + f" | {short[m['best']]} | {short[m['opsched_choice']]} | {m['speedup_vs_default']:.2f}x"
            f" | {m['speedup_vs_recommended']:.2f}x | {'yes' if m['within_5pct'] else 'NO'}"
            f" ({m['choice_over_best_ci90'][0]:.2f}-{m['choice_over_best_ci90'][1]:.2f})"
            f" | {short[m['sim_choice']]} ({'ok' if m['sim_within_5pct'] else 'off'})"
            f" | {m['others_busy_cores']:.2f} |"
        )
    lines += [
        "",
        f"Geometric-mean speed-up of opsched's choice: {r['mean_speedup_vs_default']:.2f}x over tf-default, "
        f"{r['mean_speedup_vs_recommended']:.2f}x over tf-recommended; within 5% of the sweep's best for "
        f"{sum(m['within_5pct'] for m in r['models'])}/{len(r['models'])} models.",
        "",
        "'sim pick': the setting the simulator (analytic model, no measurement) ranks first, and whether it is "
        "within 5% of the best. 'others' cores': median CPU cores busy with other processes per sweep round.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
