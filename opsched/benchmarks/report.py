"""The report of ``opsched bench``: ``report.md`` (headline table first) and the PNG figures.

Kept apart from the measuring code so each stays readable: everything here
reads the ``results`` dict that :mod:`opsched.benchmarks.run_all` also saves as
``results.json``, so a report can be re-rendered from a saved run
(``python -m opsched.benchmarks.report runs/bench_<N>``) without measuring again.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H

ALTERNATIVES = ("eager-1t", "compile", "ort-seq", "ort-par")  # what users would pick instead of opsched
LABELS = {"eager": "eager", "eager-1t": "eager 1 thread", "compile": "torch.compile",
          "ort-seq": "ORT sequential", "ort-par": "ORT parallel", "opsched-ort": "opsched (ORT)"}


# ======================================================================= report
def label_of(label: str) -> str:
    """A configuration's display name: ``opsched:heft`` -> ``opsched heft``."""
    return LABELS.get(label) or label.replace("opsched:", "opsched ")


def ratio_cell(g: dict[str, Any], label: str) -> str:
    if label in g.get("ratio", {}):
        return H.fmt_ratio(g["ratio"][label])
    why = g.get("skipped", {}).get(label)
    return "skipped" if why else "—"


def headline(real: dict[str, Any]) -> tuple[list[str], str, list[dict[str, Any]]]:
    """The headline table's lines, the gap sentence, and per-row gap figures."""
    col = "opsched:" + real.get("opsched_column", "critical-path-first")
    head = ["model", "batch", "eager ms", *(LABELS[a] for a in ALTERNATIVES), f"opsched ({col[8:]}, PyTorch)",
            "opsched (ORT)", "best alternative", "opsched / best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    gaps = []
    for g in real.get("groups", []):
        if "eager" not in g.get("time_s", {}):
            continue
        eager_ms = g["time_s"]["eager"]["median"] * 1e3
        alts = {a: g["ratio"][a]["median"] for a in ("eager", *ALTERNATIVES) if a in g.get("ratio", {})}
        best = min(alts, key=alts.__getitem__)
        mine = [g.get("ratio", {}).get(k, {}).get("median") for k in (_resolve(g, col), "opsched-ort")]
        ours = min((x for x in mine if x), default=None)  # the faster of opsched's two runtimes
        gap = ours / alts[best] if ours else None
        if gap is not None:
            gaps.append({"model": g["model"], "batch": g["batch"], "best": best, "gap": gap, "opsched": ours})
        cells = [g["model"], str(g["batch"]), f"{eager_ms:.2f}", *(ratio_cell(g, a) for a in ALTERNATIVES),
                 ratio_cell(g, _resolve(g, col)), ratio_cell(g, "opsched-ort"), f"{LABELS[best]} ({alts[best]:.2f})",
                 f"**{gap:.2f}**" if gap is not None else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    if not gaps:
        return lines, "No opsched figure was measured, so there is no gap to name.", gaps
    worst = max(gaps, key=lambda x: x["gap"])
    if worst["gap"] > 1:
        sentence = (f"**Largest gap to the best alternative: {worst['model']} at batch {worst['batch']}** -- opsched "
                    f"(the faster of its PyTorch and ORT runs) takes {worst['gap']:.2f}x the time of {LABELS[worst['best']]}.")
    else:
        sentence = (f"opsched (the faster of its PyTorch and ORT runs) is at least as fast as every alternative on every row; its narrowest "
                    f"lead is {worst['model']} at batch {worst['batch']} ({worst['gap']:.2f}x the time of "
                    f"{LABELS[worst['best']]}).")
    return lines, sentence, gaps


def _resolve(g: dict[str, Any], label: str) -> str:
    """A policy whose plan equals an earlier one's was timed under that one's label."""
    name = label[8:] if label.startswith("opsched:") else label
    twin = g.get("identical_plans", {}).get(name)
    return f"opsched:{twin}" if twin else label


def md_real(real: dict[str, Any]) -> list[str]:
    L = ["## 1. Real execution on this machine", "",
         f"Time per inference relative to eager PyTorch with its default threads (< 1 is faster): median over "
         f"{real['rounds']} interleaved rounds of {real['iters']} calls each after {real['warmup']} warm-up calls "
         "(quartiles in brackets); every configuration in its own process. "
         "opsched's rows are plans of its policies run by its PyTorch CPU runtime (`TorchCPUBackend.execute`). "
         f"Plans were made with the planning model `opsched apply` uses: {real.get('performance_model', '?')}.", ""]
    for key, why in real.get("skipped_groups", {}).items():
        L.append(f"- {key}: skipped: {why}")
    for g in real.get("groups", []):
        L += [f"### {g['model']} (batch {g['batch']}, {g['ops']} ops, width {g['width']})", "",
              *([f"> {g['load_warning'][0].upper()}{g['load_warning'][1:]}.", ""] if g.get("load_warning") else []),
              "| configuration | ms per inference | ratio to eager | output vs eager | note |", "|---|---:|---:|---|---|"]
        labels = list(g.get("time_s", {}))
        for lab in labels:
            t = g["time_s"][lab]
            note = ""
            name = lab[8:] if lab.startswith("opsched:") else lab
            if lab.startswith("opsched:"):
                twins = [k for k, v in g.get("identical_plans", {}).items() if v == name]
                note = f"decided in {g['decision_s'].get(name, float('nan')) * 1e3:.1f} ms"
                if twins:
                    note += f"; same plan as {', '.join(twins)}"
            elif lab == "compile" and "compile" in g.get("workers", {}):
                note = f"compiled in {g['workers']['compile'].get('compile_s', float('nan')):.0f} s"
            out_chk = g.get("outputs", {}).get(lab, "")
            L.append(f"| {label_of(lab)} | {t['median'] * 1e3:.2f} ({t['q1'] * 1e3:.2f}–{t['q3'] * 1e3:.2f}) "
                     f"| {H.fmt_ratio(g['ratio'].get(lab))} | {out_chk} | {note} |")
        for lab, why in g.get("skipped", {}).items():
            L.append(f"| {label_of(lab)} | skipped | | | {why[:300]} |")
        L.append("")
    losses = []
    for g in real.get("groups", []):
        alts = {a: g["ratio"][a]["median"] for a in ("eager", *ALTERNATIVES) if a in g.get("ratio", {})}
        if not alts:
            continue
        best = min(alts, key=alts.__getitem__)
        for lab, r in g.get("ratio", {}).items():
            if lab.startswith("opsched:") and r["median"] > alts[best] * 1.02:
                losses.append(f"{g['model']} b{g['batch']}: opsched {lab[8:]} {r['median']:.2f} vs "
                              f"{LABELS[best]} {alts[best]:.2f}")
    L += ["**Where opsched loses** (its plan more than 2% slower than the best alternative in the same run):", ""]
    L += [f"- {x}" for x in losses] or ["- nowhere in this run"]
    L.append("")
    return L


def md_keras(k: dict[str, Any]) -> list[str]:
    L = ["### 1b. TensorFlow: Keras application models", "",
         "The zoo models have no TensorFlow twin, so TensorFlow is measured on Keras applications "
         "(`weights=None`): its default thread setting, the recommended one and opsched's choice, "
         "via `python -m opsched.benchmarks.keras_settings`.", ""]
    if "skipped" in k:
        return L + [f"skipped: {k['skipped']}", ""]
    r = k["result"]
    L += [f"Command: `{k['command']}`", "", "| model | tf-default ms | tf-recommended ms | opsched ms (setting) | "
          "best ms (setting) | vs default | vs recommended | within 5% of best |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for m in r.get("models", []):
        L.append(f"| {m['model']} | {m['tf_default_s'] * 1e3:.2f} | {m['tf_recommended_s'] * 1e3:.2f} | "
                 f"{m['opsched_s'] * 1e3:.2f} ({m['opsched_choice']}) | {m['best_s'] * 1e3:.2f} ({m['best']}) | "
                 f"{m['speedup_vs_default']:.2f}x | {m['speedup_vs_recommended']:.2f}x | "
                 f"{'yes' if m['within_5pct'] else 'NO'} |")
    L += ["", f"opsched's choice: {r.get('opsched_choice_method', '?')}.", ""]
    return L


def md_sim(s: dict[str, Any]) -> list[str]:
    L = ["## 2. Scale in the simulator", "",
         f"Validation graphs ({', '.join(s['graphs'])}; from {s['graph_source']}) on every preset machine, "
         f"analytic performance model. Search: Optuna, {s['search_trials']} trials per graph. Learned policy: "
         f"{s['learned']}. Geometric means over graphs: makespan / lower bound (1 = the physical limit), "
         "speedup over sequential; median time to decide.", ""]
    pols = s["policies"]
    L += ["| machine | " + " | ".join(pols) + " |", "|---|" + "---:|" * len(pols)]
    for pname, by in s["summary"].items():
        cells = []
        for p in pols:
            v = by.get(p)
            cells.append(f"{v['gmean_lb_ratio']:.2f} / {v['gmean_speedup']:.2f}x / {_fmt_s(v['median_decision_s'])}"
                         if v else "skipped")
        L.append(f"| {pname} | " + " | ".join(cells) + " |")
    L += ["", "Each cell: makespan / lower bound, speedup over sequential, decision time.", ""]
    if any("gmean_tight_lb_ratio" in v for by in s["summary"].values() for v in by.values()):
        L += ["Against the allocation LP's bound and the best plan any policy here found for the pair "
              "(geometric means): makespan / LP bound, makespan / best known.", "",
              "| machine | " + " | ".join(pols) + " |", "|---|" + "---:|" * len(pols)]
        for pname, by in s["summary"].items():
            cells = [f"{by[p]['gmean_tight_lb_ratio']:.2f} / {by[p]['gmean_best_known_ratio']:.2f}"
                     if by.get(p) and "gmean_tight_lb_ratio" in by[p] else "—" for p in pols]
            L.append(f"| {pname} | " + " | ".join(cells) + " |")
        L.append("")
    for key, why in s.get("skipped", {}).items():
        L.append(f"- {key}: skipped: {why}")
    if "learned" not in pols:
        L.append(f"- learned policy: skipped: {s['learned']}")
    L += ["", "![simulator scale](sim_scale.png)", ""]
    return L


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.1f} s"


def md_costs(c: dict[str, Any]) -> list[str]:
    L = ["## 3. Costs of the machinery", ""]
    for key, title in (("runtime_overhead", "Runtime overhead per op"), ("sim_speed", "Simulator speed"),
                       ("env_speed", "Environment speed"),
                       ("plan_speed", "Planning speed of the exported scheduler (plan_speed)")):
        v = c.get(key)
        if v is None:
            continue
        if "skipped" in v:
            L.append(f"- **{title}**: skipped: {v['skipped']}")
            continue
        if key == "plan_speed":
            sm = v.get("summary", {})
            L.append(f"- **{title}** (`{v.get('command')}`): target {sm.get('target', '?')}: "
                     f"**{'met' if sm.get('met') else 'NOT met'}** on the median case, "
                     f"{'met' if sm.get('met_worst') else 'NOT met'} on the worst; "
                     "median CPU ms by size in the table below")
            continue
        flat = _flatten(v.get("summary", {}))
        L.append(f"- **{title}** (`{v.get('command')}`): " + "; ".join(f"{k} = {_fmt_val(x)}" for k, x in flat.items()))
    p = c.get("planning", {})
    L += ["", "**Planning time by graph size** (median of repeats; heuristics: layered graphs on knl-68, wall "
          "clock in this process; learned: `opsched.benchmarks.plan_speed`'s median CPU time on one core over families "
          "and machines):", ""]
    if "skipped" in p:
        L.append(f"skipped: {p['skipped']}")
    else:
        pols = sorted({r["policy"] for r in p["rows"]})
        sizes = sorted({r["ops"] for r in p["rows"]})
        L += ["| ops | " + " | ".join(pols) + " |", "|---:|" + "---:|" * len(pols)]
        for n in sizes:
            cells = []
            for pol in pols:
                r = next((x for x in p["rows"] if x["ops"] == n and x["policy"] == pol), None)
                cells.append("—" if r is None else ("error" if "error" in r else f"{r['median_ms']:.1f} ms"))
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        if not any(r["policy"].startswith("learned") for r in p["rows"]):
            L += ["", f"Exported scheduler: skipped: {p.get('learned')}"]
        L += ["", "![planning time](planning_time.png)"]
    t = c.get("train_to_beat_cpf", {})
    L += ["", "**Training time to beat critical-path-first** (validation geometric mean <= 1): "
          + (f"skipped: {t['skipped']}" if "skipped" in t else
             (f"{t['run']}: after {t['steps']:.0f} steps, {t['wall_s']:.0f} s (ratio {t['gmean_cpf']:.3f})"
              if t.get("beat_cpf") else f"{t['run']}: not reached in {t['final_steps']:.0f} steps / "
              f"{t['final_wall_s']:.0f} s (last ratio {t['final_gmean_cpf']:.3f})")
             + (f"; the run's command: `{t['command']}`" if t.get("command") else "")), ""]
    return L


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
            if not isinstance(v, dict):
                out[f"{prefix}{k}"] = v
    return out


def _fmt_val(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def md_ort(o: dict[str, Any]) -> list[str]:
    """Section 5: the ``ort`` planning model against plans measured on ONNX Runtime."""
    from opsched.benchmarks.ort_bench import markdown

    body = markdown({"sim_to_real": o}).split("\n## Sim-to-real on plans the runtime model was not fitted on\n", 1)
    text = body[1] if len(body) == 2 else ""
    return ["## 5. Fidelity of the ort backend's planning model", "",
            f"Planning model: {o.get('planning_model', '?')}. Simulated against measured wall time of plans the "
            "runtime model was not fitted on (`opsched.benchmarks.ort_bench.sim_to_real`).", "",
            *text.strip("\n").splitlines(), ""]


def md_fidelity(f: dict[str, Any]) -> list[str]:
    from opsched.benchmarks.sim_to_real import COLUMNS, TARGET_MDAPE, TARGET_SPEARMAN, score_table, why_empty

    L = ["## 4. Fidelity: the planning model against measured makespans", "",
         f"Plans of each zoo model (batch 1) measured on this machine's PyTorch CPU runtime and simulated with "
         f"the model `opsched apply` plans with ({f['planning_model']}, from `{f['profiles']}`), on fresh plans "
         f"(ones the runtime model was not fitted on); beside it {' and '.join(list(COLUMNS.values())[1:])}. "
         f"Targets: median absolute error <= {TARGET_MDAPE:.0%}, Spearman >= {TARGET_SPEARMAN}. "
         f"Source: `{f['command']}` (its report: `{f['report']}`).", "", *score_table(f), ""]
    if not why_empty(f):
        L += ["![fidelity scatter](fidelity.png)", ""]
    return L


def write_report(out: Path, results: dict[str, Any]) -> None:
    from opsched.io import atomic_write_text

    S = results["sections"]
    load = results["machine"].get("loadavg") or [float("nan")]
    L = ["# opsched benchmark report", "",
         f"Command: `{results['command']}` ({'quick smoke run' if results['quick'] else 'full run'}), "
         f"{results['started']}, {results.get('elapsed_s', 0) / 60:.1f} min.  ",
         f"Machine: {H.describe_machine_line(results['machine'])}; load average {load[0]:.1f} "
         f"at start{', ' + format(results['loadavg_end'][0], '.1f') + ' at end' if results.get('loadavg_end') else ''}.",
         ""]
    cores = results["machine"].get("usable_cpus") or results["machine"].get("cpu_count") or 1
    if math.isfinite(load[0]) and load[0] > 1.25 * cores:
        L += [f"> **Shared machine:** the load average ({load[0]:.1f}) exceeded the {cores} CPUs when this run "
              "started; other processes competed for the cores, so times (multi-threaded ones most) are "
              "inflated and noisy. Rerun on a quiet machine for figures to quote.", ""]
    real = S.get("real", {})
    L += ["## Headline: time per inference on this machine, relative to eager PyTorch", ""]
    if "skipped" in real or not real:
        L += [f"skipped: {real.get('skipped', 'section not run')}", ""]
    else:
        lines, sentence, _ = headline(real)
        L += ["Ratios of time per inference to eager PyTorch with its default threads (< 1 is faster), median "
              "(quartiles) of interleaved rounds, measured in this one run. 'opsched' is "
              + ("its learned policy" if real.get("opsched_column") == "learned" else
                 "critical-path-first (no exported learned policy was found)")
              + " on opsched's PyTorch CPU runtime.", "", *lines, "", sentence, "",
              "![ratios to eager](real_ratios.png)", ""]
    L += md_real(real) if real.get("groups") is not None else []
    if "keras" in S:
        L += md_keras(S["keras"])
    for key, fn in (("sim", md_sim), ("costs", md_costs), ("fidelity", md_fidelity), ("ort", md_ort)):
        if key not in S:
            continue
        sec = S[key]
        if "skipped" in sec and len(sec) == 1:
            title = {"sim": "## 2. Scale in the simulator", "costs": "## 3. Costs of the machinery",
                     "fidelity": "## 4. Fidelity", "ort": "## 5. Fidelity of the ort backend's planning model"}[key]
            L += [title, "", f"skipped: {sec['skipped']}", ""]
        else:
            L += fn(sec)
    L += ["## Environment", "", f"Performance model for this machine: {results.get('performance_model')}.  ",
          f"Learned policy: {results.get('learned')}.  ",
          "Packages: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items() if v) + ".  ",
          "Raw figures: `results.json`; machine: `machine.json`; versions: `versions.json`; sub-benchmark outputs "
          "and worker logs: `sub/`.", ""]
    atomic_write_text(out / "report.md", "\n".join(L))


# ======================================================================= figures
def plot_real(real: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    groups = [g for g in real.get("groups", []) if g.get("ratio")]
    labels = ["eager-1t", "compile", "ort-seq", "ort-par"]
    opsched = sorted({lab for g in groups for lab in g["ratio"] if lab.startswith("opsched:")})
    labels += opsched
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(groups) + 3), 4.8))
    width = 0.8 / max(1, len(labels))
    x = np.arange(len(groups))
    for j, lab in enumerate(labels):
        med = [g["ratio"].get(lab, {}).get("median", np.nan) for g in groups]
        lo = [m - g["ratio"].get(lab, {}).get("q1", np.nan) for m, g in zip(med, groups)]
        hi = [g["ratio"].get(lab, {}).get("q3", np.nan) - m for m, g in zip(med, groups)]
        ax.bar(x + (j - (len(labels) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=2,
               label=label_of(lab), hatch="//" if lab.startswith("opsched:") else None)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, [f"{g['model']}\nb{g['batch']}" for g in groups])
    ax.set_ylabel("time / eager PyTorch (default threads)\n< 1 is faster")
    ax.set_yscale("log")
    ax.set_title("Time per inference on this machine, relative to eager PyTorch")
    ax.legend(fontsize=7, ncol=2, loc="best")
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    H.save_figure(fig, path)


def plot_sim(s: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    presets, pols = list(s["summary"]), s["policies"]
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(presets) + 3), 4.8))
    width = 0.8 / max(1, len(pols))
    x = np.arange(len(presets))
    for j, p in enumerate(pols):
        vals = [s["summary"][m].get(p, {}).get("gmean_lb_ratio", np.nan) for m in presets]
        ax.bar(x + (j - (len(pols) - 1) / 2) * width, vals, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="lower bound")
    ax.set_xticks(x, presets)
    ax.set_ylabel("makespan / lower bound (geometric mean)")
    ax.set_yscale("log")
    ax.set_title("Validation graphs in the simulator: distance to the physical limit")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    H.save_figure(fig, path)


def plot_planning(p: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pol in sorted({r["policy"] for r in p["rows"]}):
        rs = [r for r in p["rows"] if r["policy"] == pol and "median_ms" in r]
        ax.plot([r["ops"] for r in rs], [r["median_ms"] for r in rs], marker="o", label=pol)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops in the graph")
    ax.set_ylabel("time to produce a Plan (ms)")
    ax.set_title("Planning time by graph size (knl-68)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    H.save_figure(fig, path)


def write_figures(out: Path, results: dict[str, Any]) -> dict[str, str]:
    import matplotlib

    from opsched.benchmarks.sim_to_real import plot as plot_fidelity
    from opsched.benchmarks.sim_to_real import why_empty

    matplotlib.use("Agg")
    S, made = results["sections"], {}
    for key, fname, fn, ok in (
        ("real", "real_ratios.png", plot_real, lambda s: any(g.get("ratio") for g in s.get("groups", []))),
        ("sim", "sim_scale.png", plot_sim, lambda s: bool(s.get("summary"))),
        ("costs", "planning_time.png", lambda s, p: plot_planning(s["planning"], p),
         lambda s: "rows" in s.get("planning", {})),
        ("fidelity", "fidelity.png", plot_fidelity, lambda s: "rows" in s and not why_empty(s)),
    ):
        sec = S.get(key)
        if sec and ok(sec):
            try:
                fn(sec, out / fname)
                made[key] = fname
            except Exception as exc:
                made[key] = f"failed: {type(exc).__name__}: {exc}"
    return made


def render(out: Path) -> None:
    """Re-render report.md and the figures of a saved run folder from its results.json."""
    results = json.loads((out / "results.json").read_text())
    results["figures"] = write_figures(out, results)
    write_report(out, results)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise SystemExit("usage: python -m opsched.benchmarks.report runs/bench_<N>")
    render(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
