"""The default search at two or more prices of a local-search step, on the selection sets.

:func:`opsched.policies.budget.search_budget` buys a small graph's extra
local-search steps with its spare op units, at
:data:`~opsched.policies.budget.STEP_COST` units per step and op.  That price
is measured (``python -m opsched.benchmarks.budget_costs``); when a step gets
cheaper (the compiled replay; one call per step instead of a Python pass over
the ops) the same planning time buys more steps.  This benchmark plans the
selection sets of ``python -m opsched.benchmarks.rejected --what bicpa`` (the
validation split's graphs of at most 128 ops, the hard families' training
pairs, the training split's synthetic graphs on two training machines each:
nothing the test split holds) with the default search at each price, per plan
seed: makespan over the best of every baseline heuristic, the steps the
budget bought, and CPU ms per plan (the prices interleaved, their order
turned round every seed, the heuristics' cache cleared before each plan).

    python -m opsched.benchmarks.step_cost --costs 0.005,0.002,0.0015 --seeds 3 --out docs/bench
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opsched.timing import geomean


def tag(cost: float) -> str:
    """A price's name in the rows: ``c0.005``."""
    return f"c{cost:g}"


def run(policy: Any, costs: Sequence[float], seeds: Sequence[int], quick: bool = False) -> dict[str, Any]:
    """Per pair, plan seed and price: the default search's makespan over the best baseline's,
    its local-search steps and its CPU ms."""
    from opsched.benchmarks.harness import timed_plan
    from opsched.benchmarks.rejected import bicpa_set_pairs, patched
    from opsched.policies import budget
    from opsched.policies.hints import clear_cache

    rows = []
    for g, m, sim, best, row in bicpa_set_pairs(policy, quick):
        for k, seed in enumerate(seeds):
            for cost in (costs if k % 2 == 0 else costs[::-1]):
                with patched(budget, "STEP_COST", cost):
                    plan = timed_plan(policy, g, m, row, tag(cost), seed=seed)
                    row.setdefault(f"{tag(cost)}_default", []).append(sim.makespan(g, plan) / best)
                    row[f"{tag(cost)}_steps"] = int(plan.meta["refine_steps"])
        rows.append(row)
    clear_cache()
    return {"costs": list(costs), "seeds": list(seeds), "rows": rows,
            "summary": summarise(rows, costs, len(seeds))}


def summarise(rows: Sequence[dict[str, Any]], costs: Sequence[float], n_seeds: int) -> dict[str, Any]:
    """Per set and price: the geometric mean per seed and their mean, (pair, seed) cases better and
    worse than the first price, median steps and median CPU ms per plan."""
    out: dict[str, Any] = {}
    first = tag(costs[0])
    for set_name in dict.fromkeys(r["set"] for r in rows):
        sel = [r for r in rows if r["set"] == set_name]
        s: dict[str, Any] = {"pairs": len(sel)}
        for cost in costs:
            t = tag(cost)
            per_seed = [geomean(r[f"{t}_default"][k] for r in sel) for k in range(n_seeds)]
            cases = [(r[f"{first}_default"][k], r[f"{t}_default"][k]) for r in sel for k in range(n_seeds)]
            s[t] = {"per_seed": per_seed, "mean": float(np.mean(per_seed)),
                    "better": sum(b < a * (1 - 1e-9) for a, b in cases),
                    "worse": sum(b > a * (1 + 1e-9) for a, b in cases),
                    "steps_median": float(np.median([r[f"{t}_steps"] for r in sel])),
                    "ms_median": float(np.median([np.median(r[f"{t}_ms"]) for r in sel])),
                    "ms_max": float(max(np.median(r[f"{t}_ms"]) for r in sel))}
        out[set_name] = s
    return out


def write_markdown(res: dict[str, Any], path: Path) -> None:
    from opsched.io import atomic_write_text

    costs = ",".join(f"{c:g}" for c in res["costs"])
    lines = ["# The default search at each price of a local-search step (small graphs)", "",
             f"`python -m opsched.benchmarks.step_cost --costs {costs} --seeds {len(res['seeds'])}`; "
             f"{res['seconds']:.0f} s, load {res['load'][0]:.2f} -> {res['load'][1]:.2f}.  Makespan over the best "
             "baseline heuristic's, geometric mean per plan seed (and their mean); *changed*: (pair, seed) cases "
             f"better / worse than at {res['costs'][0]:g}; median local-search steps; CPU ms per default plan, "
             "median (and the slowest pair's median).  Selection sets only (no test pair).", "",
             "| set | pairs | step cost | default per seed | mean | changed | steps | ms | ms, slowest pair |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, s in res["summary"].items():
        for cost in res["costs"]:
            v = s[tag(cost)]
            lines.append(f"| {name} | {s['pairs']} | {cost:g} | {' / '.join(f'{x:.4f}' for x in v['per_seed'])} | "
                         f"{v['mean']:.4f} | {v['better']} / {v['worse']} | {v['steps_median']:.0f} | "
                         f"{v['ms_median']:.1f} | {v['ms_max']:.1f} |")
    atomic_write_text(path, "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.budget import STEP_COST
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.step_cost",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--costs", default=None,
                    help=f"comma-separated step prices in op units, the first the reference (default: 0.005 and the "
                         f"shipped {STEP_COST:g})")
    ap.add_argument("--seeds", type=int, default=3, help="plan seeds (0..N-1) of the default search")
    ap.add_argument("--quick", action="store_true", help="two pairs per set")
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args(argv)
    try:
        costs = [float(x) for x in args.costs.split(",")] if args.costs else list(dict.fromkeys((0.005, STEP_COST)))
    except ValueError:
        ap.error(f"--costs must be comma-separated numbers, got {args.costs!r}")
    if args.seeds < 1 or not costs or any(not c > 0 for c in costs):
        ap.error("--seeds must be >= 1 and every --costs price > 0")
    policy = load(args.policy or pretrained_path())
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    res = run(policy, costs, range(args.seeds), args.quick)
    res.update(policy=str(policy.folder), seconds=time.perf_counter() - t0, load=[load0, os.getloadavg()[0]])
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "step_cost.json", json.dumps(res, indent=1) + "\n")
    write_markdown(res, args.out / "step_cost.md")
    for name, s in res["summary"].items():
        print(f"{name}: " + ", ".join(f"{c:g}: {s[tag(c)]['mean']:.4f} ({s[tag(c)]['ms_median']:.0f} ms)"
                                      for c in costs))
    print(f"-> {args.out / 'step_cost.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
