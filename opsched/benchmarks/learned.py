"""The learned policy on the test split: ratios to the best heuristic, plan-time search curves, optimality gaps.

Every figure is on the test split of ``opsched.agents.splits`` (never trained
or selected on): per (graph, machine) pair the simulated makespan of the
learned policy - greedy decoding alone, and with its default plan-time search
(sampled decodings plus every heuristic as a candidate) - divided by the best
heuristic's, under the pair's planning model (the analytic model on the
presets; on ``local``, this machine's fitted profiles plus its runtime model
when ``opsched profile`` made them).  Also:

* the K-versus-quality and K-versus-time curves of the plan-time search
  (K sampled decodings), and the planning time of 200-op graphs on one core;
* the gap to a long per-graph search (Optuna, ``--search-trials``);
* the gap to exact optima of small graphs (<= 25 ops) on a few cores:
  OR-Tools CP-SAT solves the multi-mode scheduling problem the simulator
  poses without co-run interference (a bound no plan can beat there).

``python bench/learned.py`` writes ``runs/bench/learned.{json,md}`` and the curves' PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsched.cache import graphs_dir
from opsched.timing import geomean, host_record

#: K values of the plan-time search curve.
K_CURVE = (0, 1, 2, 4, 8)


def test_pairs(quick: bool = False) -> list[tuple[str, str, str]]:
    """(group, graph spec, machine spec) of the test split: CPU presets x the
    non-placement graphs, GPU presets x every graph, placement graphs
    reported as their own group, ``local`` x the zoo and Keras graphs; the
    training steps as the group ``step`` on every preset (not on ``local``:
    its profiled model holds inference ops only unless ``opsched profile
    --mode train`` ran)."""
    from opsched.agents import splits

    steps = list(splits.TEST_STEP_GRAPHS)
    graphs = [g for g in splits.TEST_GRAPHS if g not in splits.TEST_STEP_GRAPHS]
    if quick:
        graphs = [g for g in graphs if not g.startswith("keras:")][:6] + list(splits.TEST_PLACEMENT_GRAPHS[:1])
        steps = steps[:1]
    placement = set(splits.TEST_PLACEMENT_GRAPHS)
    out = [("step", g, m) for m in (*splits.TEST_CPU_MACHINES, *splits.TEST_GPU_MACHINES) for g in steps]
    for m in splits.TEST_CPU_MACHINES:
        out += [("cpu", g, m) for g in graphs if g not in placement]
    for m in splits.TEST_GPU_MACHINES:
        out += [("placement" if g in placement else "gpu", g, m) for g in graphs]
    out += [("local", g, "local") for g in graphs if g.startswith(("zoo:", "keras:"))]
    return out


def planning_model_for(machine_spec: str, machine: Any) -> Any:
    """The model a user plans with on this machine: analytic on a preset, the
    profiled model (plus the runtime model) on ``local``."""
    from opsched.planning import planning_model

    return planning_model(machine.cpu_only() if machine_spec == "local" else machine,
                          "torch-cpu" if machine_spec == "local" else "sim", "auto")


def evaluate(policy: Any, pairs: Sequence[tuple[str, str, str]], ks: Sequence[int] = K_CURVE,
             cache_dir: str | Path | None = None, progress: Any = None) -> list[dict[str, Any]]:
    """One row per pair: the heuristics' makespans, the policy's greedy one, and
    per K the plan-time search's makespan, winner and planning seconds."""
    from opsched.backends.sim import SimBackend
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    graphs: dict[str, Any] = {}
    for group, gspec, mspec in pairs:
        graph = graphs.get(gspec)
        if graph is None:
            graph = graphs[gspec] = load_graph(gspec, cache_dir=cache_dir)
        machine = load_machine(mspec)
        if mspec == "local":
            machine = machine.cpu_only()
        model = planning_model_for(mspec, machine)
        sim = SimBackend(machine, model)
        # the reference: the best of every baseline (the moldable-task ones included), not only the hint heuristics
        heur = {k: v[1] for k, v in heuristic_plans(graph, machine, model, names(BASELINE)).items()}
        best = min(heur, key=heur.__getitem__)
        row: dict[str, Any] = {"group": group, "graph": gspec, "machine": mspec, "ops": len(graph.ops),
                               "model": model.name, "heuristics": heur, "best_heuristic": best,
                               "best_s": heur[best], "k": {}}
        t0 = time.perf_counter()
        greedy = policy.plan(graph, machine, model, samples=0, candidates=(), refine=0)
        row["greedy_plan_s"] = time.perf_counter() - t0
        row["greedy_s"] = float(sim.run(graph, greedy).makespan)
        # slots whose decision is the hint's (followed member by member; engine/slots.Follow)
        row["greedy_hint_kept"] = [int(greedy.meta.get("followed", 0)), int(greedy.meta["slots"])]
        row["greedy_hint"] = greedy.meta.get("hint")  # the heuristic whose plan hinted it
        no_refine = policy.plan(graph, machine, model, refine=0)
        row["no_refine_s"] = float(sim.run(graph, no_refine).makespan)
        for k in ks:
            t0 = time.perf_counter()
            plan = policy.plan(graph, machine, model, samples=k)
            dt = time.perf_counter() - t0
            row["k"][str(k)] = {"makespan_s": float(sim.run(graph, plan).makespan), "chosen": plan.meta["chosen"],
                                "plan_s": dt}
        rows.append(row)
        if progress is not None:
            progress()
    return rows


def summarise(rows: Sequence[dict[str, Any]], default_k: int) -> dict[str, Any]:
    """Geometric means and worst pairs of the ratios to the best heuristic, per group."""
    out: dict[str, Any] = {}
    for group in sorted({r["group"] for r in rows}) + ["all"]:
        sel = [r for r in rows if group in ("all", r["group"])]
        greedy = [r["greedy_s"] / r["best_s"] for r in sel]
        default = [r["k"][str(default_k)]["makespan_s"] / r["best_s"] for r in sel]
        no_refine = [r["no_refine_s"] / r["best_s"] for r in sel]
        curve = {k: geomean([r["k"][k]["makespan_s"] / r["best_s"] for r in sel]) for k in sel[0]["k"]}
        times = {k: statistics.median(r["k"][k]["plan_s"] for r in sel) for k in sel[0]["k"]}
        # a learned (or refined) plan that only ties a heuristic's (the greedy decoding that
        # follows its hint in every slot and in its order) is no win: count the strictly faster
        wins = sum(not r["k"][str(default_k)]["chosen"].startswith("heuristic:")
                   and r["k"][str(default_k)]["makespan_s"] < r["best_s"] * (1.0 - 1e-9) for r in sel)
        kept = [r["greedy_hint_kept"] for r in sel]
        out[group] = {"pairs": len(sel), "greedy_gmean": geomean(greedy), "greedy_worst": max(greedy),
                      "default_gmean": geomean(default), "default_worst": max(default),
                      "no_refine_gmean": geomean(no_refine),
                      "policy_chosen": wins, "k_gmean": curve, "k_plan_s_median": times,
                      "hint_kept": sum(k for k, _ in kept) / sum(n for _, n in kept)}
    return out


def planning_speed(policy: Any, repeats: int = 5) -> dict[str, Any]:
    """Median CPU seconds to plan a 200-op graph (default plan-time search) on one
    core, over the synthetic families and a CPU and a GPU preset.

    The process is pinned to one CPU and its BLAS / OpenMP pools to one thread
    meanwhile (as the other planning benchmarks: ``plan_search``, ``plan_budget``),
    then put back: unpinned, CPU time also counts helper threads spinning on the
    other core.  ``pinned`` says what was done."""
    from opsched.benchmarks.harness import one_core

    with one_core() as pinned:
        out = _planning_times(policy, repeats)
    out["median_s"] = statistics.median(out.values())
    return {**out, "pinned": pinned}


def planning_by_machine(sp: dict[str, Any]) -> str:
    """``planning_speed``'s figures per machine, in words: "knl-68 80-89 ms, dgx1-4v100 93-138 ms"."""
    by: dict[str, list[float]] = {}
    for k, v in sp.items():
        if "@" in k:
            by.setdefault(k.split("@", 1)[1], []).append(1e3 * float(v))
    return ", ".join(f"{m} {min(v):.0f}-{max(v):.0f} ms" for m, v in by.items())


def planning_runs(policy: Any, runs: int, out: Path) -> dict[str, Any]:
    """``runs`` rounds of :func:`planning_speed` alone (what ``--planning-only`` writes to
    ``planning_speed.{json,md}``): the 100 ms target's figure without the rest of the bench."""
    from opsched.io import atomic_write_text

    rounds = []
    for _ in range(runs):
        load0 = os.getloadavg()
        sp = planning_speed(policy)
        rounds.append({**sp, "load_start": [round(x, 2) for x in load0],
                       "load_end": [round(x, 2) for x in os.getloadavg()]})
    res = {"policy": str(policy.folder), "host": host_record(), "rounds": rounds}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "planning_speed.json", json.dumps(res, indent=1, default=str))
    lines = ["# Planning a 200-op graph with the default search", "",
             "`python bench/learned.py --planning-only N`: per round, the median over 5 plans of each of 3 "
             "synthetic 200-op graphs on a CPU and a GPU preset (one core, CPU time, the heuristics included), "
             "and the median over the 6 cases; issue 23's target is 100 ms.", "",
             "| round | median ms | per machine | load |", "|---:|---:|---|---|"]
    for k, r in enumerate(rounds):
        lines.append(f"| {k} | {r['median_s'] * 1e3:.1f} | {planning_by_machine(r)} | "
                     f"{r['load_start'][0]} -> {r['load_end'][0]} |")
    atomic_write_text(out / "planning_speed.md", "\n".join(lines) + "\n")
    for k, r in enumerate(rounds):
        print(f"round {k}: median {r['median_s'] * 1e3:.1f} ms ({planning_by_machine(r)})")
    return res


def _planning_times(policy: Any, repeats: int) -> dict[str, float]:
    from opsched.machine import get_machine
    from opsched.specs import load_graph

    out = {}
    for gspec in ("layered:200:911", "erdos_renyi:200:912", "watts_strogatz:200:913"):
        g = load_graph(gspec)
        for mspec in ("knl-68", "dgx1-4v100"):
            m = get_machine(mspec)
            policy.plan(g, m)  # warm: time tables, hints cache
            ts = []
            for r in range(repeats):
                from opsched.policies.hints import clear_cache

                clear_cache()  # the heuristics are part of the planning time
                t0 = time.process_time()
                policy.plan(g, m, seed=r)
                ts.append(time.process_time() - t0)
            out[f"{gspec}@{mspec}"] = statistics.median(ts)
    return out


def search_gaps(policy: Any, trials: int, quick: bool) -> list[dict[str, Any]]:
    """The policy (default search) against a long per-graph Optuna search, on the zoo test graphs."""
    from opsched.agents import splits
    from opsched.backends.sim import SimBackend
    from opsched.policies import get_policy
    from opsched.specs import load_graph, load_machine

    graphs = [g for g in splits.TEST_GRAPHS if g.startswith("zoo:")][: 2 if quick else None]
    rows = []
    for gspec in graphs:
        g = load_graph(gspec)
        for mspec in splits.TEST_CPU_MACHINES[:1] + splits.TEST_GPU_MACHINES[:1]:
            m = load_machine(mspec)
            sim = SimBackend(m)
            mine = float(sim.run(g, policy.plan(g, m)).makespan)
            t0 = time.perf_counter()
            found = float(sim.run(g, get_policy("search", n_trials=trials, seed=0).plan(g, m)).makespan)
            rows.append({"graph": gspec, "machine": mspec, "learned_s": mine, "search_s": found,
                         "ratio": mine / found, "search_seconds": time.perf_counter() - t0, "trials": trials})
    return rows


def exact_gaps(policy: Any, n_graphs: int = 8, time_limit_s: float = 20.0) -> list[dict[str, Any]]:
    """The policy against CP-SAT's optimum on small graphs (<= 25 ops) on a
    4-core CPU without co-run interference (its memory bandwidth is ample):
    :func:`opsched.engine.bounds.cpsat_schedule`, whose proven bound no plan
    can beat there."""
    from opsched.engine.bounds import cpsat_schedule, require_ortools
    from opsched.errors import OpschedError

    try:
        require_ortools()
    except OpschedError as exc:
        return [{"skipped": str(exc)}]
    from opsched.backends.sim import SimBackend
    from opsched.machine import get_machine
    from opsched.policies.hints import best_heuristic
    from opsched.specs import load_graph

    m = get_machine("cpu:4:50:10000")
    rows = []
    for k in range(n_graphs):
        fam = ("layered", "erdos_renyi", "watts_strogatz")[k % 3]
        g = load_graph(f"{fam}:{12 + 13 * (k % 2)}:{950 + k}")
        res = cpsat_schedule(g, m, time_limit_s=time_limit_s)
        if res.plan is None:
            rows.append({"graph": g.name, "skipped": f"CP-SAT found no solution in time ({res.status})"})
            continue
        opt = res.cp_makespan_s
        sim = SimBackend(m)
        mine = float(sim.run(g, policy.plan(g, m)).makespan)
        heur = best_heuristic(g, m)[2]
        rows.append({"graph": g.name, "ops": len(g.ops), "optimum_s": opt, "proved_optimal": res.optimal,
                     "lower_bound_s": res.lower_bound_s, "cp_plan_s": res.makespan_s,
                     "learned_s": mine, "best_heuristic_s": heur, "learned_gap": mine / opt - 1.0,
                     "heuristic_gap": heur / opt - 1.0})
    return rows


def write_markdown(res: dict[str, Any], path: Path) -> None:
    s = res["summary"]
    lines = [f"# Learned policy on the test split ({res['policy']})", "",
             f"`{res['command']}` on {res['host']['host']} ({res['host']['cpu_count']} CPUs), load average "
             f"{res['load_start']} -> {res['load_end']}; {res['seconds']:.0f} s.", "",
             "Makespan / best heuristic's (< 1: the policy is faster; the best of every baseline heuristic, CPA, "
             "biCPA and LP rounding included), geometric mean over the pairs, and the worst pair.",
             "*greedy*: the policy's decoding alone (hinted with the fastest plan of its hint heuristics and "
             "the heuristics the default search adds for the graph; *hint*: which); *default*: with its plan-time search "
             f"({res['default_k']} sampled decodings + every heuristic as a candidate, the best improved by "
             f"{res['refine']} local-search steps); *no refine*: the same without the local search; "
             "*hint kept*: the share of the greedy decoding's slot decisions that are the hint's (each then "
             "follows the hint's plan member by member).", "",
             "| group | pairs | greedy gmean | greedy worst | hint kept | no refine gmean | default gmean | "
             "default worst | learned or refined plan faster than every heuristic |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, v in s.items():
        lines.append(f"| {g} | {v['pairs']} | {v['greedy_gmean']:.3f} | {v['greedy_worst']:.3f} | {v['hint_kept']:.3f} | "
                     f"{v['no_refine_gmean']:.3f} | {v['default_gmean']:.3f} | {v['default_worst']:.3f} | "
                     f"{v['policy_chosen']} |")
    allk = s["all"]
    lines += ["", "Plan-time search: K sampled decodings (plus the heuristics) vs quality and planning time "
              "(median over all pairs):", "", "| K | gmean / best heuristic | median planning s |", "|---:|---:|---:|"]
    for k in allk["k_gmean"]:
        lines.append(f"| {k} | {allk['k_gmean'][k]:.3f} | {allk['k_plan_s_median'][k]:.3f} |")
    sp = res.get("planning_speed")
    if sp:
        pairs = [k for k in sp if "@" in k]
        lines += ["", f"Planning a 200-op graph (default search, heuristics included, one core, CPU time; "
                      f"{sp.get('pinned', 'not pinned')}): median {sp['median_s'] * 1e3:.1f} ms over {len(pairs)} "
                      f"graph/machine pairs ({planning_by_machine(sp)})."]
    if res.get("search"):
        r = res["search"]
        lines += ["", f"Against a {r[0]['trials']}-trial Optuna search per graph: geometric mean "
                      f"{geomean([x['ratio'] for x in r]):.3f} over {len(r)} pairs (< 1: the policy is faster)."]
    ex = [x for x in res.get("exact", []) if "optimum_s" in x]
    if ex:
        lines += ["", f"Against CP-SAT optima of {len(ex)} small graphs ({sum(x['proved_optimal'] for x in ex)} proved "
                      f"optimal): learned within {100 * max(x['learned_gap'] for x in ex):.1f}% (median "
                      f"{100 * statistics.median(x['learned_gap'] for x in ex):.1f}%), best heuristic within "
                      f"{100 * max(x['heuristic_gap'] for x in ex):.1f}%."]
    elif res.get("exact"):
        lines += ["", f"Exact optima: {res['exact'][0].get('skipped')}"]
    lines += ["", "## Pairs", "", "| group | graph | machine | best heuristic | hint | greedy | default | chosen |",
              "|---|---|---|---|---|---:|---:|---|"]
    for r in res["rows"]:
        d = r["k"][str(res["default_k"])]
        lines.append(f"| {r['group']} | {r['graph']} | {r['machine']} | {r['best_heuristic']} | {r.get('greedy_hint')} | "
                     f"{r['greedy_s'] / r['best_s']:.3f} | {d['makespan_s'] / r['best_s']:.3f} | {d['chosen']} |")
    path.write_text("\n".join(lines) + "\n")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for g, v in s.items():
        ks = [int(k) for k in v["k_gmean"]]
        a.plot(ks, list(v["k_gmean"].values()), marker="o", label=g)
        b.plot(ks, [1e3 * t for t in v["k_plan_s_median"].values()], marker="o", label=g)
    a.axhline(1.0, color="black", linewidth=0.8)
    a.set_xlabel("K sampled decodings")
    a.set_ylabel("makespan / best heuristic (geo-mean)")
    b.set_xlabel("K sampled decodings")
    b.set_ylabel("planning time, median (ms)")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="bench/learned.py", description=doc_summary(__doc__))
    ap.add_argument("--policy", default=str(pretrained_path()), help="exported policy folder (default: shipped)")
    ap.add_argument("--out", default="runs/bench", help="output folder")
    ap.add_argument("--quick", action="store_true", help="a few pairs, no search and exact sections")
    ap.add_argument("--search-trials", type=int, default=500, help="trials of the long per-graph search")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--no-exact", action="store_true")
    ap.add_argument("--planning-only", type=int, default=0, metavar="RUNS",
                    help="only time planning a 200-op graph, RUNS rounds (-> planning_speed.{json,md})")
    args = ap.parse_args(argv)
    if args.planning_only < 0:
        ap.error("--planning-only must be >= 0")
    policy = load(args.policy)
    if args.planning_only:
        planning_runs(policy, args.planning_only, Path(args.out))
        return 0
    overlap = policy.meta.get("source", {}).get("test_split_overlap") or []
    if overlap:
        print(f"refusing to report: the policy's run trained or selected on test data {overlap}")
        return 2
    t0 = time.time()
    load0 = host_record()["loadavg"]
    pairs = test_pairs(args.quick)
    default_k = int(policy.planning()["samples"])
    ks = sorted({*((0, 1, 2) if args.quick else K_CURVE), default_k})
    rows = evaluate(policy, pairs, ks, cache_dir=graphs_dir())
    res: dict[str, Any] = {
        "policy": args.policy, "command": "python bench/learned.py " + " ".join(argv or []),
        "host": host_record(), "load_start": load0, "default_k": default_k, "rows": rows,
        "refine": int(policy.planning()["refine"]),
        "summary": summarise(rows, default_k),
        "planning_speed": planning_speed(policy, 3 if args.quick else 5),
        "search": [] if args.quick or args.no_search else search_gaps(policy, args.search_trials, args.quick),
        "exact": [] if args.quick or args.no_exact else exact_gaps(policy),
    }
    res["seconds"] = time.time() - t0
    res["load_end"] = host_record()["loadavg"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "learned.json", json.dumps(res, indent=1, default=float))
    write_markdown(res, out / "learned.md")
    plot(res, out / "learned.png")
    for g, v in res["summary"].items():
        print(f"{g:10s} pairs {v['pairs']:3d}  greedy x{v['greedy_gmean']:.3f} (worst {v['greedy_worst']:.3f}, "
              f"hint kept {v['hint_kept']:.3f})  "
              f"default x{v['default_gmean']:.3f} (worst {v['default_worst']:.3f})")
    print(f"wrote {out / 'learned.md'}")
    return 0


__all__ = ["evaluate", "exact_gaps", "main", "planning_by_machine", "planning_runs", "planning_speed", "search_gaps", "summarise", "test_pairs"]
