"""Sim-to-real: how well the model ``opsched apply`` plans with predicts measured makespans.

The headline scores exactly that model (:func:`headline_model`: the fitted
profiles plus the runtime model ``opsched profile`` stored) on *fresh* plans,
none of which the runtime model was fitted on; beside it, the runtime model
refitted on the other zoo models' measurements (leave one model out) and the
performance model alone say where the error comes from.  Plans, measurement
and fitting are ``opsched.backends.runtime_fit``'s; the raw measurements are
saved before any analysis, and ``--from-raw`` re-scores them.

    python -m opsched.benchmarks.sim_to_real                 # runs/bench/sim_to_real.{json,md,png}
    python -m opsched.benchmarks.sim_to_real --quick --models lstm
    python -m opsched.benchmarks.sim_to_real --from-raw runs/bench/sim_to_real_raw.json --out /tmp/s2r
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsched.backends.runtime_fit import (
    DETAIL_PLANS,
    QUIET_CORES,
    GraphRef,
    RuntimeRun,
    fit_runtime,
    make_plans,
    measure,
    plan_digest,
    record_path,
    runtime_run,
    scores,
    simulate,
)
from opsched.benchmarks.harness import DEFAULT_OUT, doc_summary, save_figure
from opsched.cache import profiles_dir
from opsched.errors import OpschedError
from opsched.timing import summary
from opsched.zoo import ZOO

if TYPE_CHECKING:
    from opsched.engine.contracts import PerfModel
    from opsched.graph import OpGraph
    from opsched.machine import Machine
    from opsched.plan import Plan

ZOO_MODELS = tuple(ZOO)
TARGET_MDAPE = 0.15
TARGET_SPEARMAN = 0.8
#: ``calibrate`` makes the plans the runtime model is fitted on with seed 0; the evaluation's differ.
FRESH_SEED = 1
RAW_FORMAT = "sim_to_real_raw/3"
#: Simulated columns: the headline (the planning model), then the two that say where its error comes from.
COLUMNS = {"simulated_s": "planning model", "simulated_lomo_s": "runtime refit, model left out",
           "simulated_raw_s": "performance model alone"}


# ====================================================================== plans
def fitted_on_digests(graph: Any, machine: Any, cache_dir: str | Path) -> set[str]:
    """Digests of the plans of ``graph`` that the stored runtime model was fitted on
    (its measurement record; none when ``opsched profile`` measured no plan of it)."""
    from opsched.plan import Plan

    path = record_path(graph, machine, "torch-cpu", cache_dir)
    if not path.is_file():
        return set()
    try:
        return {plan_digest(Plan.from_dict(p)) for p in json.loads(path.read_text())["plans"].values()}
    except (OSError, ValueError, KeyError, TypeError):
        return set()  # an unreadable record is skipped by the fit too (runtime_fit.load_runs)


def evaluation_plans(graph: OpGraph, machine: Machine, model: PerfModel, n: int, seen: set[str]
                     ) -> tuple[dict[str, Plan], set[str]]:
    """At least ``n`` *fresh* plans (made with :data:`FRESH_SEED` by ``model``, none
    of them in ``seen``), plus ``DETAIL_PLANS`` even when seen (their per-op
    durations feed the left-out refit); returns the plans and the fresh names."""
    want = n
    for _ in range(8):
        made = make_plans(graph, machine, model, want, seed=FRESH_SEED)
        fresh = {k for k, p in made.items() if plan_digest(p) not in seen}
        if len(fresh) >= n:
            break
        want += n - len(fresh)
    return {k: p for k, p in made.items() if k in fresh or k in DETAIL_PLANS}, fresh


# ==================================================================== scoring
def score(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, float] | None:
    """:func:`~opsched.backends.runtime_fit.scores` of column ``key`` over ``rows``
    (None when no row has both a simulated and a measured time)."""
    pairs = [(r[key], r["measured_s"]) for r in rows
             if math.isfinite(r.get(key, math.nan)) and math.isfinite(r["measured_s"]) and r["measured_s"] > 0]
    if not pairs:
        return None
    sim, meas = zip(*pairs)
    return scores(sim, meas)


def analyse(runs: Sequence[RuntimeRun], machine: Machine, planning: PerfModel, perf: PerfModel,
            fresh: Mapping[str, set[str]]) -> dict[str, Any]:
    """Per plan its measured time and the three simulated columns (:data:`COLUMNS`);
    per model and pooled the scores over the fresh plans."""
    from opsched.engine.models.runtime import PlanningModel

    rows, refits = [], {}
    for r in runs:
        others = [x for x in runs if x is not r]
        refit = fit_runtime(others, machine, perf) if others else None
        refits[r.name] = refit.to_dict() if refit is not None else None
        head = simulate(r.graph, machine, planning, r.plans)
        lomo = simulate(r.graph, machine, PlanningModel(perf, refit), r.plans) if refit is not None else {}
        for p in r.plans:
            s = summary(r.walls[p])
            rows.append({"model": r.name, "plan": p, "ops": len(r.graph.ops), "group": r.group(p),
                         "serial": r.serial[p], "fresh": p in fresh.get(r.name, ()), "digest": plan_digest(r.plans[p]),
                         "measured_s": s["median"], "measured_q1_s": s["q1"], "measured_q3_s": s["q3"],
                         "busy_s": summary(r.busy[p])["median"], "samples": s["n"],
                         "simulated_s": head[p], "simulated_lomo_s": lomo.get(p, math.nan),
                         "simulated_raw_s": r.sim_raw[p]})
    scored = [x for x in rows if x["fresh"]]
    per_model = {}
    for r in runs:
        sel = [x for x in scored if x["model"] == r.name]
        per_model[r.name] = {"ops": len(r.graph.ops), "plans": len(r.plans), "fresh": len(sel),
                             **{k: score(sel, k) for k in COLUMNS}, "refit": refits[r.name],
                             "others_cores_median": summary(c for v in r.others.values() for c in v)["median"]}
    pooled: dict[str, Any] = {"plans": len(scored)}
    for k in COLUMNS:
        pooled[k] = score(scored, k)
        rhos = [v[k]["spearman"] for v in per_model.values() if v[k] is not None]
        if pooled[k] is not None:
            pooled[k]["spearman_per_model_median"] = summary(rhos)["median"]
    return {"rows": rows, "per_model": per_model, "pooled": pooled}


# ==================================================================== report
def _pct(s: Mapping[str, float] | None, key: str = "mdape") -> str:
    return "—" if s is None or not math.isfinite(s[key]) else f"{100 * s[key]:.1f}%"


def _rho(s: Mapping[str, float] | None) -> str:
    return "—" if s is None or not math.isfinite(s["spearman"]) else f"{s['spearman']:.2f}"


def _met(s: Mapping[str, float] | None) -> str:
    if s is None or not math.isfinite(s["spearman"]):
        return "—"
    return "**met**" if s["mdape"] <= TARGET_MDAPE and s["spearman"] >= TARGET_SPEARMAN else "missed"


def why_empty(res: Mapping[str, Any]) -> str | None:
    """Why the headline has no figure (None when it has one)."""
    if not res.get("rows"):
        return "no plan was measured"
    if not res["pooled"]["plans"]:
        return ("every measured plan is one the runtime model was fitted on (`opsched profile` measured them), "
                "so none can be scored as fresh")
    if res["pooled"]["simulated_s"] is None:
        return "no fresh plan has both a simulated and a measured time"
    return None


def score_table(res: Mapping[str, Any]) -> list[str]:
    """The per-model and pooled table (markdown lines), or the reason it is empty."""
    empty = why_empty(res)
    if empty:
        return [f"No figure: {empty}."]
    lines = ["| model | ops | profiled | fresh plans | MdAPE | Spearman | target | MdAPE, refit left out | "
             "Spearman, refit left out | MdAPE, perf. model alone | Spearman, perf. model alone | others' cores |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for m, v in res["per_model"].items():
        prof = {True: "yes", False: "no"}.get(v.get("profiled"), "?")
        cells = [f"{_pct(v[k])} | {_rho(v[k])}" for k in COLUMNS]
        lines.append(f"| {m} | {v['ops']} | {prof} | {v['fresh']} of {v['plans']} | {cells[0]} | "
                     f"{_met(v['simulated_s'])} | {cells[1]} | {cells[2]} | {v['others_cores_median']:.2f} |")
    p = res["pooled"]
    cells = [f"{_pct(p[k])} | {_rho(p[k])}" for k in COLUMNS]
    lines.append(f"| **pooled** | | | {p['plans']} | {cells[0]} | {_met(p['simulated_s'])} | {cells[1]} | "
                 f"{cells[2]} | |")
    med = p["simulated_s"]["spearman_per_model_median"]
    lines += ["", "Pooled Spearman is over all fresh (model, plan) points"
              + (f"; the median of the per-model coefficients is {med:.2f}." if math.isfinite(med) else ".")
              + (" No left-out refit: it needs the measurements of two models or more." if p["simulated_lomo_s"]
                 is None else "")]
    return lines


def describe_runtime(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "-"
    return (f"x{c['insitu_factor']:.2f} + {c['op_overhead_s'] * 1e6:.1f} us/op, team wake "
            f"{c['thread_switch_s'] * 1e6:.0f} us, hand-off {c['handoff_s'] * 1e6:.0f} us, "
            f"spin {c['spin_s'] * 1e3:.1f} ms, host {c['host_s'] * 1e6:.0f} us, c0 {c['corun_c0']:.2f}, "
            f"team {c['team_overhead_s'] * 1e6:.0f} us")


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}" if math.isfinite(x) else "—"


def _ape(sim: float, real: float) -> str:
    return f"{100 * abs(sim - real) / real:.1f}%" if math.isfinite(sim) and real > 0 else "—"


def write_markdown(res: Mapping[str, Any], path: Path) -> None:
    from opsched.io import atomic_write_text

    la0, la1 = res["loadavg_start"], res["loadavg_end"]
    lines = [
        "# Sim-to-real: the planning model against measured makespans", "",
        f"`{res['command']}` on {res['machine']}; torch {res['torch']}; {res['elapsed_s']:.0f} s. "
        f"Load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} at start, "
        f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} at end; other processes used a median "
        f"{res['others_cores_median']:.2f} of the {res['cores']} cores during the samples."
        + (f" Measurements re-used from `{res['reused_measurements_from']}`." if res.get("reused_measurements_from")
           else ""), "",
        f"Planning model: {res['planning_model']} (`planning_model(machine.cpu_only(), 'torch-cpu', 'fitted', "
        f"'{res['profiles']}')`, what `opsched apply` plans with); "
        + (f"its runtime model was fitted by `opsched profile` on {', '.join(res['runtime_fitted_on'])}. "
           if res["runtime_fitted_on"] else "no runtime model was fitted on any measured plan. ")
        + f"Plans: `runtime_fit.make_plans` with "
        f"seed {res['fresh_seed']} (the fit's plans use seed 0); *fresh* plans are those the runtime model was "
        "not fitted on, and only they are scored (seq-1t and seq-all are measured for the left-out refit "
        "even when they were fitted on).", "",
        f"Measured: `TorchCPUBackend` wall time in one worker process (`runtime_fit.measure`); {res['rounds']} "
        f"rounds visit every (model, plan), each in a fresh child forked from the worker ({res['warmup']} warm-up "
        f"runs, then the median of {res['reps']} runs = one sample); the figure is the median of the samples. "
        f"{res['retries']} samples taken again because other processes used more than {res['quiet_cores']} cores; "
        f"{res['samples_not_quiet']} kept above that limit. Columns: {'; '.join(COLUMNS.values())} (the runtime "
        "model refitted on the other models' measurements of this run).",
        f"Targets: MdAPE <= {TARGET_MDAPE:.0%}, Spearman >= {TARGET_SPEARMAN}.", "",
        *score_table(res), "",
        "| model | refit on the other models |", "| --- | --- |",
        *[f"| {m} | {describe_runtime(v['refit'])} |" for m, v in res["per_model"].items()], ""]
    for m in res["per_model"]:
        lines += [f"## {m}", "", "| plan | fresh | kind | measured ms (q1-q3) | planning model ms | APE | "
                  "refit left out ms | APE | perf. model alone ms | APE |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in (x for x in res["rows"] if x["model"] == m):
            me = x["measured_s"]
            cells = " | ".join(f"{_ms(x[k])} | {_ape(x[k], me)}" for k in COLUMNS)
            lines.append(f"| {x['plan']} | {'yes' if x['fresh'] else 'no'} | {x['group']} | {_ms(me)} "
                         f"({_ms(x['measured_q1_s'])}-{_ms(x['measured_q3_s'])}) | {cells} |")
        lines.append("")
    atomic_write_text(path, "\n".join(lines))


def plot(res: Mapping[str, Any], path: Path) -> None:
    """Simulated against measured (fresh plans), log-log, one colour per model, the
    y = x line; one panel per simulated column that has points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [x for x in res["rows"] if x["fresh"]]
    keys = [k for k in COLUMNS if any(math.isfinite(x[k]) for x in rows)]
    if not keys:
        raise ValueError(f"nothing to plot: {why_empty(res) or 'no simulated column has a value'}")
    vals = [x[k] for x in rows for k in ("measured_s", *keys) if math.isfinite(x[k]) and x[k] > 0]
    lo, hi = min(vals) / 1.3 * 1e3, max(vals) * 1.3 * 1e3
    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 5.5), sharex=True, sharey=True, squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for j, m in enumerate(res["per_model"]):
            s = res["per_model"][m][key]
            label = f"{m} (MdAPE {_pct(s)}, rho {_rho(s)})"
            for serial, marker in ((True, "o"), (False, "^")):
                sel = [x for x in rows if x["model"] == m and x["serial"] is serial and math.isfinite(x[key])]
                ax.scatter([x["measured_s"] * 1e3 for x in sel], [x[key] * 1e3 for x in sel], s=18,
                           color=colours(j % 10), marker=marker, alpha=0.8, label=label if serial else None)
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
        for f in (1.15, 1 / 1.15):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.7)
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured makespan (ms)",
               title=COLUMNS[key])
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, which="both", alpha=0.2)
    axes[0][0].set_ylabel("simulated makespan (ms)")
    fig.suptitle("Sim-to-real, fresh plans (o: never co-run, ^: co-running; dotted: ±15%)")
    fig.tight_layout()
    save_figure(fig, path)


# =================================================================== re-use
def reused_digests(data: Mapping[str, Any], model: str) -> dict[str, str | None]:
    """``{plan: digest}`` of ``model`` in an earlier raw file (``digests``) or full report (``rows``)."""
    if "digests" in data:
        return dict(data["digests"].get(model, {}))
    return {x["plan"]: x.get("digest") for x in data.get("rows", []) if x["model"] == model}


def read_raw(path: str | Path) -> dict[str, Any]:
    """An earlier run's ``sim_to_real_raw.json`` or ``sim_to_real.json``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpschedError(f"--from-raw {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict) or "measurement" not in data:
        raise OpschedError(f"--from-raw {path}: not a sim_to_real raw file or report (no 'measurement'); files of "
                           "the old format (before the per-plan digests) cannot be re-analysed")
    return data


def check_reuse(data: Mapping[str, Any], model: str, plans: Mapping[str, Any]) -> None:
    """The file must hold measurements of exactly these plans of ``model``."""
    if model not in data["measurement"].get("models", {}) or \
            reused_digests(data, model) != {k: plan_digest(p) for k, p in plans.items()}:
        raise OpschedError(f"--from-raw: the file has no measurements of exactly these {model!r} plans (a "
                           "different planning model - profiles or runtime model - makes different plans)")


# ====================================================================== run
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.sim_to_real",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--models", default=",".join(ZOO_MODELS), help="comma-separated zoo models")
    ap.add_argument("--mode", choices=("infer", "train"), default="infer",
                    help="train: the models' training steps (train:zoo:NAME@BATCH, SGD; profile them first with "
                         "`opsched profile --mode train`)")
    ap.add_argument("--batch", type=int, default=0, help="batch of the graphs (default 1; 4 with --mode train)")
    ap.add_argument("--plans-per-model", type=int, default=24, help="fresh plans per model (at least 20)")
    ap.add_argument("--rounds", type=int, default=0, help="measured rounds: samples per plan (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each measurement")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per measurement (their median is one sample)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no further round after this many seconds of measuring (default 330; quick 90)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 1 warm-up + 2 runs (a smoke run)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default runs/bench)")
    ap.add_argument("--profiles", default=str(profiles_dir()),
                    help="profile cache of `opsched profile`: the profiles and the runtime model (default: the per-user cache, `opsched cache --path`)")
    ap.add_argument("--from-raw", "--reuse", dest="from_raw", metavar="FILE",
                    help="re-analyse the measurements of an earlier run (its sim_to_real_raw.json or "
                         "sim_to_real.json) instead of measuring; the plans must be the same")
    ap.add_argument("--quiet-cores", type=float, default=QUIET_CORES,
                    help="a sample counts as quiet when other processes used at most this many cores (default 0.3)")
    ap.add_argument("--settle-s", type=float, default=0.3, help="pause after a sample that was not quiet")
    ap.add_argument("--max-tries", type=int, default=2,
                    help="measurements of a plan per round at most when others are busy (the quietest is kept)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.budget_s = args.budget_s or (90.0 if args.quick else 330.0)
    if args.quick:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 2)
    if args.plans_per_model < 20:
        ap.error("--plans-per-model must be at least 20 (the target is judged on 20 plans or more)")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()] if isinstance(args.models, str) \
        else list(args.models)
    unknown = [m for m in args.models if m not in ZOO_MODELS]
    if unknown:
        ap.error(f"unknown zoo model(s) {', '.join(unknown)}; choose from {', '.join(ZOO_MODELS)}")
    return args


def graph_spec(model: str, args: argparse.Namespace) -> str:
    """The spec of the graph scored for zoo ``model``: its inference graph or (``--mode train``) its
    training step (forward, loss, backward, SGD's update), at ``--batch``."""
    mode, batch = getattr(args, "mode", "infer"), getattr(args, "batch", 0)
    if mode == "train":
        return f"train:zoo:{model}@{batch or 4}"
    return f"zoo:{model}@{batch}" if batch else f"zoo:{model}"


def headline_model(machine: Machine, profiles: str | Path) -> PerfModel:
    """What ``opsched apply`` plans with on ``machine`` (CPU only) from ``profiles``."""
    from opsched.planning import planning_model, quiet_profiles

    if not quiet_profiles(machine, profiles):
        raise OpschedError(f"no usable profile of this machine in {profiles}, so there is no fitted planning model "
                           "to score: run `opsched profile zoo:<model>` for the zoo models (or `opsched bench "
                           "--profile`)")
    return planning_model(machine, "torch-cpu", "fitted", profiles)


def evaluate(args: argparse.Namespace, command: str,
             on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Make the plans, measure them (or re-use ``args.from_raw``), score them; the result
    (``sim_to_real.json``'s content).  The raw measurements are saved to
    ``args.out/sim_to_real_raw.json`` before any analysis; a re-analysis makes
    the plans again with today's planning model and needs the file's plan
    digests to match.  Per model and pooled: median absolute percentage error
    and Spearman's rank correlation (targets :data:`TARGET_MDAPE`,
    :data:`TARGET_SPEARMAN`)."""
    from opsched.engine.models.runtime import PlanningModel
    from opsched.engine.profiles import cache_path
    from opsched.io import atomic_write_text
    from opsched.machine import Machine
    from opsched.planning import describe
    from opsched.specs import load_graph

    def progress(what: str, done: int, total: int) -> None:
        if on_progress is not None:
            on_progress(what, done, total)

    t0 = time.time()
    reuse = read_raw(args.from_raw) if args.from_raw else None
    machine = Machine.probe().cpu_only()
    planning = headline_model(machine, args.profiles)
    perf = planning.perf if isinstance(planning, PlanningModel) else planning
    total = len(args.models) + args.rounds
    graphs, plans, fresh, status = {}, {}, {}, {}
    for i, m in enumerate(args.models):
        progress(f"{m}: plans", i, total)
        graphs[m] = load_graph(graph_spec(m, args))
        plans[m], fresh[m] = evaluation_plans(graphs[m], machine, planning, args.plans_per_model,
                                              fitted_on_digests(graphs[m], machine, args.profiles))
        status[m] = cache_path(graphs[m], machine, args.profiles).is_file()
    digests = {m: {k: plan_digest(p) for k, p in ps.items()} for m, ps in plans.items()}
    if reuse is not None:
        for m in args.models:
            check_reuse(reuse, m, plans[m])
        meas = reuse["measurement"]
    else:
        progress(f"measuring {sum(map(len, plans.values()))} plans", len(args.models), total)
        meas = measure(machine, {m: GraphRef(graph_spec(m, args)) for m in plans}, plans, rounds=args.rounds,
                       warmup=args.warmup, reps=args.reps, budget_s=args.budget_s, min_rounds=min(3, args.rounds),
                       quiet_cores=args.quiet_cores, settle_s=args.settle_s, max_tries=args.max_tries,
                       on_round=lambda r: progress("measuring", len(args.models) + r, total))
        atomic_write_text(Path(args.out) / "sim_to_real_raw.json", json.dumps({  # before any analysis
            "format": RAW_FORMAT, "measurement": meas, "digests": digests,
            "fresh": {m: sorted(f) for m, f in fresh.items()}}, indent=1))
    progress("scoring", total, total)
    runs = [runtime_run(m, graphs[m], plans[m], meas["models"][m], machine, perf) for m in args.models]
    res = analyse(runs, machine, planning, perf, fresh)
    for m, v in res["per_model"].items():
        v["profiled"] = status[m]
    runtime = getattr(planning, "runtime", None)
    res.update({
        "command": command, "graphs": {m: graph_spec(m, args) for m in args.models},
        "machine": f"{machine.cpu.name} ({machine.cpu.cores} cores)", "cores": machine.cpu.cores,
        "torch": meas.get("torch"), "rounds": meas["rounds"], "warmup": meas["warmup"], "reps": meas["reps"],
        "elapsed_s": time.time() - t0, "quiet_cores": meas["quiet_cores"], "retries": meas["retries"],
        "samples_not_quiet": meas["samples_not_quiet"], "max_tries": meas.get("max_tries"),
        "loadavg_start": list(meas["loadavg_start"]), "loadavg_end": list(meas["loadavg_end"]),
        "others_cores_median": summary(c for r in runs for v in r.others.values() for c in v)["median"],
        "profiles": str(args.profiles), "planning_model": describe(planning),
        "runtime_fitted_on": list(getattr(runtime, "fitted_on", ())), "fresh_seed": FRESH_SEED,
        "reused_measurements_from": args.from_raw, "targets": {"mdape": TARGET_MDAPE, "spearman": TARGET_SPEARMAN},
        "digests": digests, "measurement": meas,
    })
    return res


def write_outputs(res: Mapping[str, Any], out: Path) -> None:
    """``sim_to_real.json``, ``.md`` and (when there are fresh points) ``.png`` in ``out``."""
    from opsched.io import atomic_write_text

    atomic_write_text(out / "sim_to_real.json", json.dumps(res, indent=1))
    write_markdown(res, out / "sim_to_real.md")
    if not why_empty(res):
        plot(res, out / "sim_to_real.png")


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    import opsched.benchmarks.harness as H

    args = parse_args(argv)
    command = "python -m opsched.benchmarks.sim_to_real " + " ".join(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=True)
    try:
        with H.progress_bar(console) as bar:
            task = bar.add_task("sim-to-real", total=1, detail="")
            res = evaluate(args, command, lambda what, done, total: bar.update(task, completed=done, total=total,
                                                                               detail=what))
    except OpschedError as exc:
        console.print(f"[bold red]error:[/bold red] {exc}")
        return 2
    out = Path(args.out)
    write_outputs(res, out)
    for line in score_table(res):
        print(line)
    print(f"wrote {out / 'sim_to_real.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
