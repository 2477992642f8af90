"""Spending a small graph's spare planning time: the ``fill`` of the default search, chosen on validation.

The default plan-time search is sized for a 200-op graph (about 100 ms on one
core, :mod:`opsched.benchmarks.plan_search`); a smaller graph plans in a
fraction of that.  :func:`opsched.policies.budget.search_budget` spends the
rest: LP rounding joins the candidates where its cost fits, then a share
``fill`` of what is left buys more local-search steps.  This benchmark
measures, per ``fill``:

* **quality** on the selection sets - the validation split's pairs and the
  hard families' training pairs (:data:`opsched.hard.TRAIN_PAIRS`) - as the
  plan's makespan over the best of every baseline heuristic's (CPA, biCPA and
  LP rounding included), analytic model; never on the test split, which the
  test-split benchmarks (``bench/learned.py``, ``bench/hard.py``) report;
* **planning time** by graph size (25-200 ops, 3 synthetic families x 4
  presets), pinned to one core, BLAS on one thread, the heuristics' cache
  cleared before every plan: median CPU ms per size and the worst case;
* **large graphs** (``large_baselines``, graphs of more than ``budget_ops`` ops:
  training steps and zoo models of the training and validation splits, on
  the validation machines): quality and CPU ms per plan with and without
  biCPA and LP rounding as candidates on machines without GPUs.

    python -m opsched.benchmarks.plan_budget          # -> runs/bench/plan_budget.{json,md}
    python -m opsched.benchmarks.plan_budget --quick  # 2 fills, few pairs, 2 sizes
    python -m opsched.benchmarks.plan_budget --fills 0,0.7,1 --seeds 3  # and the plan seeds' spread
    python -m opsched.benchmarks.plan_budget --step-cost 0.005 --no-large  # a candidate step cost
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.benchmarks.plan_search import TIME_FAMILIES, TIME_MACHINES
from opsched.timing import geomean, host_record

#: The shares of the spare budget compared (0: the search before this benchmark: exactly ``refine`` steps).
FILLS: tuple[float, ...] = (0.0, 0.35, 0.7, 1.0)
SIZES: tuple[int, ...] = (25, 50, 100, 150, 200)


def selection_pairs() -> dict[str, list[tuple[str, str]]]:
    """The selection sets: validation pairs and the hard families' training pairs."""
    from opsched.benchmarks.plan_search import validation_pairs
    from opsched.hard import TRAIN_PAIRS

    return {"validation": validation_pairs(), "hard (training pairs)": list(TRAIN_PAIRS)}


#: Graphs of more than 200 ops the test split never sees (training and validation graphs; filtered by size when run).
LARGE_GRAPHS: tuple[str, ...] = (
    "train:zoo:randwire@4x0.5", "train:zoo:lstm@4x0.5", "train:zoo:resnet50@2x0.5:adam", "zoo:inception@1x0.5",
    "zoo:nasnet@4x1.0", "zoo:randwire@8x1.0", "zoo:lstm@16x1.0", "zoo:nasnet@1x0.5", "zoo:randwire@1x0.5",
    "zoo:lstm@1x0.5",
)


def large_pairs(budget_ops: int) -> list[tuple[str, str]]:
    """(graph, machine) pairs of :data:`LARGE_GRAPHS` above ``budget_ops`` ops on the validation machines."""
    from opsched.agents.splits import TRAIN_GRAPHS, VALIDATION_GRAPHS, VALIDATION_MACHINES
    from opsched.specs import load_graph

    assert set(LARGE_GRAPHS) <= set(TRAIN_GRAPHS) | set(VALIDATION_GRAPHS)  # never a test graph
    return [(g, m) for g in LARGE_GRAPHS if len(load_graph(g).ops) > budget_ops for m in VALIDATION_MACHINES]


def large_quality(policy: Any, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per ``large_baselines`` setting, the default plan's makespan over the best baseline
    heuristic's and its CPU ms (heuristics' cache cleared before each plan), by
    machine kind (with / without GPUs) and over all pairs."""
    import time

    from opsched.engine.sim import Simulator
    from opsched.policies.hints import clear_cache, heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(graph, machine, None, names(BASELINE)).values())
        sim = Simulator(machine)
        row: dict[str, Any] = {"graph": gspec, "machine": mspec, "ops": len(graph.ops), "gpus": len(machine.gpus)}
        for flag in (False, True):
            clear_cache()
            t0 = time.process_time()
            plan = policy.plan(graph, machine, large_baselines=flag)
            row[str(flag)] = {"ratio": sim.makespan(graph, plan) / best, "ms": (time.process_time() - t0) * 1e3,
                              "chosen": str(plan.meta["chosen"])}
        rows.append(row)
    out: dict[str, Any] = {"rows": rows}
    for kind, sel in (("cpu-only", [r for r in rows if not r["gpus"]]), ("with GPUs", [r for r in rows if r["gpus"]]),
                      ("all", rows)):
        if sel:
            out[kind] = {str(f): {"pairs": len(sel), "gmean": geomean([r[str(f)]["ratio"] for r in sel]),
                                  "worst": max(r[str(f)]["ratio"] for r in sel),
                                  "median_ms": statistics.median(r[str(f)]["ms"] for r in sel),
                                  "worst_ms": max(r[str(f)]["ms"] for r in sel)} for f in (False, True)}
    return out


def quality(policy: Any, fills: Sequence[float], pairs: Sequence[tuple[str, str]],
            seeds: Sequence[int] = (0,)) -> dict[str, Any]:
    """Per fill, the default plan's makespan over the best baseline heuristic's
    (geometric mean, worst, per pair) and the local-search steps it ran, for the
    plan seed ``seeds[0]``; with more ``seeds``, also each seed's geometric mean
    (``seed_gmeans``): local search draws its moves from the seed, and how far the
    figure moves with it is the noise any choice made on these pairs has to beat."""
    from opsched.engine.sim import Simulator
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    out: dict[str, Any] = {str(f): {"steps": [], "chosen": [], "per_seed": [[] for _ in seeds]} for f in fills}
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(graph, machine, None, names(BASELINE)).values())
        sim = Simulator(machine)
        for f in fills:
            row = out[str(f)]
            for k, seed in enumerate(seeds):
                plan = policy.plan(graph, machine, fill=f, seed=seed)
                row["per_seed"][k].append(sim.makespan(graph, plan) / best)
                if k == 0:
                    row["steps"].append(int(plan.meta["refine_steps"]))
                    row["chosen"].append(str(plan.meta["chosen"]))
    for row in out.values():
        per_seed = row.pop("per_seed")
        row["ratios"] = per_seed[0]
        row["gmean"], row["worst"] = geomean(row["ratios"]), max(row["ratios"])
        row["seed_gmeans"] = [geomean(r) for r in per_seed]
    return out


def planning_ms(policy: Any, fills: Sequence[float], sizes: Sequence[int], repeats: int,
                families: Sequence[str] = TIME_FAMILIES) -> dict[str, Any]:
    """Per fill and size, median CPU ms of the default plan over the cases, and the worst case."""
    from opsched.benchmarks.plan_speed import case_ms

    return {str(f): {str(n): case_ms(lambda g, m, f=f: policy.plan(g, m, fill=f), n, families, TIME_MACHINES, repeats)
                     for n in sizes} for f in fills}


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.policies import load
    from opsched.policies.exported import _one_blas_thread, pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.plan_budget",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--repeats", type=int, default=3, help="timed plans per case, fill and size")
    ap.add_argument("--quick", action="store_true", help="fills 0 and 0.7, 4 pairs per set, sizes 25 and 200, "
                                                              "one family, 2 repeats")
    ap.add_argument("--fills", default=None, help="comma-separated fills to compare (default: "
                                                  + ", ".join(f"{f:g}" for f in FILLS) + ")")
    ap.add_argument("--seeds", type=int, default=1, help="plan seeds per fill and pair for the quality figures "
                                                         "(more than 1: each seed's gmean and their spread, the "
                                                         "noise a choice on these pairs has to beat)")
    ap.add_argument("--step-cost", type=float, default=None,
                    help="a local-search step's cost in op units for this run (default: the shipped "
                         "opsched.policies.budget.STEP_COST; a candidate value to choose on the selection sets)")
    ap.add_argument("--no-large", action="store_true", help="leave out the graphs larger than the budget graph "
                                                            "(their search does not depend on fill or step cost)")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.step_cost is not None and not args.step_cost > 0:
        ap.error(f"--step-cost must be positive, got {args.step_cost}")
    try:
        chosen_fills = tuple(float(x) for x in args.fills.split(",")) if args.fills else None
    except ValueError:
        ap.error(f"--fills must be comma-separated numbers, got {args.fills!r}")
    if chosen_fills is not None and not all(0.0 <= f <= 1.0 for f in chosen_fills):
        ap.error(f"--fills must lie in [0, 1], got {args.fills!r}")
    fills = chosen_fills or ((0.0, 0.7) if args.quick else FILLS)
    seeds = tuple(range(args.seeds))
    sizes = (25, 200) if args.quick else SIZES
    repeats = 2 if args.quick else args.repeats
    import opsched.policies.budget as budget

    shipped_step_cost = budget.STEP_COST
    step_cost = shipped_step_cost if args.step_cost is None else args.step_cost
    pinned = H.pin_one_core()
    folder = Path(args.policy) if args.policy else pretrained_path()
    policy = load(folder)
    sets = {k: (v[:4] if args.quick else v) for k, v in selection_pairs().items()}
    load0 = host_record()["loadavg"]
    try:
        budget.STEP_COST = step_cost  # read by search_budget at every plan; put back below
        with _one_blas_thread():
            q = {name: quality(policy, fills, pairs, seeds) for name, pairs in sets.items()}
            t = planning_ms(policy, fills, sizes, repeats, TIME_FAMILIES[:1] if args.quick else TIME_FAMILIES)
            large: dict[str, Any] = {"rows": []}
            if not args.no_large:
                large_set = large_pairs(int(policy.planning()["budget_ops"]))
                large = large_quality(policy, large_set[::15] if args.quick else large_set)
    finally:
        budget.STEP_COST = shipped_step_cost
    default = policy.planning()
    result = {"benchmark": "plan_budget", "policy": str(folder), "pinning": pinned, "host": host_record(),
              "load_before": load0, "repeats": repeats, "default_fill": default["fill"], "step_cost": step_cost,
              "shipped_step_cost": shipped_step_cost,
              "budget_ops": default["budget_ops"], "refine": default["refine"],
              "sets": {k: len(v) for k, v in sets.items()}, "seeds": list(seeds), "quality": q, "planning_ms": t,
              "large": large, "default_large_baselines": default["large_baselines"]}
    set_names = list(sets)
    lines = ["# Spending a small graph's spare planning time (`fill`), chosen on validation", "",
             f"Policy `{folder}`; R = {default['refine']} steps at {default['budget_ops']} ops and above; quality: "
             "makespan over the best of every baseline heuristic (analytic model) on "
             + ", ".join(f"{k} ({len(v)} pairs)" for k, v in sets.items())
             + f"; planning time: median CPU ms per size over {len(t[str(fills[0])][str(sizes[0])]['cases'])} cases "
             f"({pinned}, BLAS 1 thread, heuristics' cache cleared, {repeats} plans each). Load average before / "
             f"after: {', '.join(f'{x:.1f}' for x in load0 or ())} / "
             f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg'] or ())}. Default fill: {default['fill']:g}. "
             f"A local-search step counted as {step_cost:g} op units"
             + ("" if step_cost == shipped_step_cost else f" (shipped: {shipped_step_cost:g})") + ".", "",
             "| fill | " + " | ".join(f"{k}: gmean | worst | median steps" for k in set_names) + " | "
             + " | ".join(f"{n} ops: ms (worst)" for n in sizes) + " |",
             "|---:|" + "---:|---:|---:|" * len(set_names) + "---:|" * len(sizes)]
    for f in fills:
        cells = []
        for k in set_names:
            row = q[k][str(f)]
            cells += [f"{row['gmean']:.4f}", f"{row['worst']:.3f}", f"{statistics.median(row['steps']):.0f}"]
        cells += [f"{t[str(f)][str(n)]['median_ms']:.0f} ({t[str(f)][str(n)]['worst_ms']:.0f})" for n in sizes]
        lines.append(f"| {f:g} | " + " | ".join(cells) + " |")
    lines += ["", "fill 0: exactly R steps and the default candidates (the search before the budget). Target: a "
                  "200-op graph in at most 100 ms (median case); a smaller graph should not take longer."]
    if len(seeds) > 1:
        lines += ["", f"### Plan seeds ({len(seeds)})", "",
                  "Local search draws its moves from the plan's seed (`plan(..., seed=)`). The table above is seed "
                  f"{seeds[0]}; here each fill's geometric mean over the pairs per seed: mean, lowest and highest. "
                  "A difference between two fills or two search variants smaller than the spread is noise.", "",
                  "| fill | " + " | ".join(f"{k}: mean | min | max" for k in set_names) + " |",
                  "|---:|" + "---:|---:|---:|" * len(set_names)]
        for f in fills:
            cells = []
            for k in set_names:
                g = q[k][str(f)]["seed_gmeans"]
                cells += [f"{statistics.fmean(g):.4f}", f"{min(g):.4f}", f"{max(g):.4f}"]
            lines.append(f"| {f:g} | " + " | ".join(cells) + " |")
    lines += [] if args.no_large else ["",
              f"## Graphs larger than the budget graph (`large_baselines`, default {default['large_baselines']})", "",
              f"{len(large['rows'])} pairs: graphs of more than {default['budget_ops']} ops of the training and "
              "validation splits on the validation machines; makespan over the best baseline heuristic's, CPU ms "
              "per plan (one core, heuristics' cache cleared). `large_baselines` adds biCPA and LP rounding as "
              "candidates on machines without GPUs only.", "",
              "| machines | pairs | without: gmean | worst | median ms | worst ms | with: gmean | worst | "
              "median ms | worst ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("cpu-only", "with GPUs", "all"):
        if kind in large:
            a, b = large[kind]["False"], large[kind]["True"]
            lines.append(f"| {kind} | {a['pairs']} | {a['gmean']:.4f} | {a['worst']:.3f} | {a['median_ms']:.0f} | "
                         f"{a['worst_ms']:.0f} | {b['gmean']:.4f} | {b['worst']:.3f} | {b['median_ms']:.0f} | "
                         f"{b['worst_ms']:.0f} |")
    lines += ["",
              "Command: `python -m opsched.benchmarks.plan_budget" + (" --quick" if args.quick else "")
              + (f" --fills {args.fills}" if args.fills else "") + (f" --seeds {args.seeds}" if args.seeds > 1 else "")
              + (f" --step-cost {args.step_cost:g}" if args.step_cost is not None else "")
              + (" --no-large" if args.no_large else "") + "`", ""]
    H.save_result(Path(args.out), "plan_budget", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
