"""The planning budget's op-unit costs, measured: what one local-search step, LP rounding and biCPA cost per op.

:func:`opsched.policies.budget.search_budget` buys a small graph's extra
local-search steps and candidates with op units, the base planning cost of
one op (the greedy decoding and the default candidates), so its rule does not
depend on how fast the planning computer is.  The constants there
(:data:`~opsched.policies.budget.STEP_COST`, :data:`~opsched.policies.budget.LP_COST`,
:data:`~opsched.policies.budget.BICPA_COST`) were measured by timing each part
alone; this benchmark is that measurement, so it can be repeated when the
planner's speed changes (the compiled makespan replay made a step much
cheaper than the base).

Per case (the three synthetic families at 25-200 ops on the planning
benchmarks' four presets, one core, BLAS on one thread, the heuristics' cache
cleared and the graph copied before every plan; median CPU time over ``repeats`` plans):

* **base**: the default search with no local search and no extra candidate
  (``refine=0, fill=0, large_baselines=False``), per op; the hint's plans are
  computed as always (:func:`opsched.policies.budget.hint_extra`: LP rounding
  on a small graph where it fits, LP rounding and biCPA on a coarsened one
  without GPUs), so the base includes them, as the budget's unit did;
* **step**: the same search with ``steps`` local-search steps, minus the base,
  per step and op, and in op units (over the base per op);
* **lp-rounding** and **bicpa**: each heuristic's plan and its replay alone
  (:func:`opsched.policies.hints.heuristic_plans`), per op, in op units.

    python -m opsched.benchmarks.budget_costs            # writes runs/bench/budget_costs.{json,md}
    python -m opsched.benchmarks.budget_costs --quick    # two sizes, one family
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opsched.benchmarks.plan_search import TIME_FAMILIES, TIME_MACHINES

SIZES: tuple[int, ...] = (25, 50, 100, 150, 200)
#: Local-search steps timed for the step cost (enough that the steps dominate the difference).
STEPS = 200


def _cpu_ms(fn: Callable[[Any], Any], graph: Any, repeats: int) -> float:
    """Median CPU ms of ``fn`` on fresh copies of ``graph``, the heuristics' cache cleared
    before each, after a warm-up: :func:`opsched.benchmarks.plan_speed.clocked_plans`,
    as the planning benchmarks time plans."""
    from opsched.benchmarks.plan_speed import clocked_plans

    return statistics.median(clocked_plans(fn, graph, repeats).cpu_s) * 1e3


def case_costs(policy: Any, graph: Any, machine: Any, repeats: int, steps: int = STEPS) -> dict[str, float]:
    """Base ms per op, a step's us per op and op units, LP rounding's and biCPA's op units, for one case."""
    from opsched.policies.hints import heuristic_plans

    n = len(graph.ops)
    base = _cpu_ms(lambda g: policy.plan(g, machine, refine=0, fill=0.0, large_baselines=False), graph, repeats)
    searched = _cpu_ms(lambda g: policy.plan(g, machine, refine=steps, fill=0.0, large_baselines=False), graph,
                       repeats)
    out = {"ops": n, "base_ms": base, "base_ms_per_op": base / n,
           "step_us_per_op": max(0.0, searched - base) * 1e3 / (steps * n)}
    out["step_units"] = out["step_us_per_op"] * 1e-3 / out["base_ms_per_op"]
    for name in ("lp-rounding", "bicpa"):
        ms = _cpu_ms(lambda g, name=name: heuristic_plans(g, machine, None, (name,)), graph, repeats)
        out[f"{name}_ms"] = ms
        out[f"{name}_units"] = ms / n / out["base_ms_per_op"]
    return out


def run(sizes: Sequence[int] = SIZES, families: Sequence[str] = TIME_FAMILIES,
        machines: Sequence[str] = TIME_MACHINES, repeats: int = 3) -> dict[str, Any]:
    """Every case's :func:`case_costs`, and the medians and ranges per machine kind (with / without GPUs)."""
    from opsched.benchmarks.harness import one_core
    from opsched.machine import get_machine
    from opsched.policies.budget import BICPA_COST, LP_COST, STEP_COST
    from opsched.policies.exported import _one_blas_thread, load, pretrained_path
    from opsched.synthetic import generate
    from opsched.timing import host_record

    policy = load(pretrained_path())
    load0 = os.getloadavg()
    rows = []
    with one_core() as pinned, _one_blas_thread():
        for n in sizes:
            for fam in families:
                for mname in machines:
                    machine = get_machine(mname)
                    row = {"family": fam, "machine": mname, "gpus": len(machine.gpus),
                           **case_costs(policy, generate(fam, n, 1000 + n), machine, repeats)}
                    rows.append(row)
                    print(f"{fam}:{n}@{mname}: base {row['base_ms_per_op']:.3f} ms/op, step "
                          f"{row['step_us_per_op']:.2f} us/op ({row['step_units']:.4f} units), LP rounding "
                          f"{row['lp-rounding_units']:.2f}, biCPA {row['bicpa_units']:.2f} units", flush=True)
    kinds: dict[str, Any] = {}
    for kind, sel in (("cpu-only", [r for r in rows if not r["gpus"]]), ("with GPUs", [r for r in rows if r["gpus"]])):
        if sel:
            kinds[kind] = {k: {"median": statistics.median(r[k] for r in sel), "min": min(r[k] for r in sel),
                               "max": max(r[k] for r in sel)}
                           for k in ("base_ms_per_op", "step_us_per_op", "step_units", "lp-rounding_units",
                                     "bicpa_units")}
    return {"benchmark": "budget_costs", "rows": rows, "kinds": kinds, "repeats": repeats, "steps": STEPS,
            "pinned": pinned, "host": host_record(), "load_start": [round(x, 2) for x in load0],
            "load_end": [round(x, 2) for x in os.getloadavg()],
            "shipped": {"STEP_COST": STEP_COST, "LP_COST": {str(k): v for k, v in LP_COST.items()},
                        "BICPA_COST": BICPA_COST}}


def markdown(res: dict[str, Any]) -> str:
    sh = res["shipped"]
    lines = ["# The planning budget's op-unit costs", "",
             f"`python -m opsched.benchmarks.budget_costs`: the shipped policy, one core ({res['pinned']}), BLAS 1 "
             f"thread, the heuristics' cache cleared and the graph copied before each plan, median CPU time over {res['repeats']} plans; "
             f"load {res['load_start'][0]} -> {res['load_end'][0]}.  An op unit is the base planning cost of one op "
             f"(no local search, no extra candidate; the hint's plans included); a step's cost is from {res['steps']} steps.  Shipped "
             f"(`policies/budget.py`): a step {sh['STEP_COST']} units, LP rounding {sh['LP_COST']['False']} "
             f"without GPUs / {sh['LP_COST']['True']} with, biCPA {sh['BICPA_COST']}.", "",
             "| machines | base ms per op | step us per op | step units | LP rounding units | biCPA units |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, k in res["kinds"].items():
        cell = [f"{k[c]['median']:.3g} ({k[c]['min']:.3g}-{k[c]['max']:.3g})"
                for c in ("base_ms_per_op", "step_us_per_op", "step_units", "lp-rounding_units", "bicpa_units")]
        lines.append(f"| {kind} | " + " | ".join(cell) + " |")
    lines += ["", "Median (range) over the cases.", "",
              "| graph | machine | ops | base ms | base ms/op | step us/op | step units | LP rounding units "
              "| biCPA units |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['family']}:{r['ops']} | {r['machine']} | {r['ops']} | {r['base_ms']:.1f} | "
                     f"{r['base_ms_per_op']:.3f} | {r['step_us_per_op']:.2f} | {r['step_units']:.4f} | "
                     f"{r['lp-rounding_units']:.2f} | {r['bicpa_units']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary, save_result

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.budget_costs",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--repeats", type=int, default=3, help="timed plans per case and part (default 3)")
    ap.add_argument("--quick", action="store_true", help="sizes 25 and 200, one family")
    ap.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    res = run((25, 200), TIME_FAMILIES[:1], repeats=args.repeats) if args.quick else run(repeats=args.repeats)
    path = save_result(Path(args.out), "budget_costs", res, markdown(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["SIZES", "STEPS", "case_costs", "main", "markdown", "run"]
