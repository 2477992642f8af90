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
  cleared before every plan: median CPU ms per size and the worst case.

    python -m opsched.benchmarks.plan_budget          # -> runs/bench/plan_budget.{json,md}
    python -m opsched.benchmarks.plan_budget --quick  # 2 fills, few pairs, 2 sizes
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


def quality(policy: Any, fills: Sequence[float], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per fill, the default plan's makespan over the best baseline heuristic's
    (geometric mean, worst, per pair) and the local-search steps it ran."""
    from opsched.engine.sim import Simulator
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    out: dict[str, Any] = {str(f): {"ratios": [], "steps": [], "chosen": []} for f in fills}
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(graph, machine, None, names(BASELINE)).values())
        sim = Simulator(machine)
        for f in fills:
            plan = policy.plan(graph, machine, fill=f)
            row = out[str(f)]
            row["ratios"].append(sim.makespan(graph, plan) / best)
            row["steps"].append(int(plan.meta["refine_steps"]))
            row["chosen"].append(str(plan.meta["chosen"]))
    for row in out.values():
        row["gmean"], row["worst"] = geomean(row["ratios"]), max(row["ratios"])
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
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder")
    args = ap.parse_args(argv)
    fills = (0.0, 0.7) if args.quick else FILLS
    sizes = (25, 200) if args.quick else SIZES
    repeats = 2 if args.quick else args.repeats
    pinned = H.pin_one_core()
    folder = Path(args.policy) if args.policy else pretrained_path()
    policy = load(folder)
    sets = {k: (v[:4] if args.quick else v) for k, v in selection_pairs().items()}
    load0 = host_record()["loadavg"]
    with _one_blas_thread():
        q = {name: quality(policy, fills, pairs) for name, pairs in sets.items()}
        t = planning_ms(policy, fills, sizes, repeats, TIME_FAMILIES[:1] if args.quick else TIME_FAMILIES)
    default = policy.planning()
    result = {"benchmark": "plan_budget", "policy": str(folder), "pinning": pinned, "host": host_record(),
              "load_before": load0, "repeats": repeats, "default_fill": default["fill"],
              "budget_ops": default["budget_ops"], "refine": default["refine"],
              "sets": {k: len(v) for k, v in sets.items()}, "quality": q, "planning_ms": t}
    set_names = list(sets)
    lines = ["# Spending a small graph's spare planning time (`fill`), chosen on validation", "",
             f"Policy `{folder}`; R = {default['refine']} steps at {default['budget_ops']} ops and above; quality: "
             "makespan over the best of every baseline heuristic (analytic model) on "
             + ", ".join(f"{k} ({len(v)} pairs)" for k, v in sets.items())
             + f"; planning time: median CPU ms per size over {len(t[str(fills[0])][str(sizes[0])]['cases'])} cases "
             f"({pinned}, BLAS 1 thread, heuristics' cache cleared, {repeats} plans each). Load average before / "
             f"after: {', '.join(f'{x:.1f}' for x in load0 or ())} / "
             f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg'] or ())}. Default fill: {default['fill']:g}.", "",
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
                  "200-op graph in at most 100 ms (median case); a smaller graph should not take longer.", "",
              "Command: `python -m opsched.benchmarks.plan_budget" + (" --quick" if args.quick else "") + "`", ""]
    H.save_result(Path(args.out), "plan_budget", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
