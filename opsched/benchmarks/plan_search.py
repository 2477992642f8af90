"""Choosing the exported scheduler's plan-time search on the validation split.

:meth:`opsched.policies.exported.ExportedPolicy.plan` returns the fastest of
its greedy decoding, ``K`` sampled decodings and its candidate heuristics'
plans (the hint heuristics, plus any others named), improved by ``R``
local-search steps.  Which ``(K, R, candidates)`` is the default is a
trade between plan quality and planning time (issue 23 asks for a 200-op
graph in at most 100 ms on one core).  This benchmark measures both for a
grid of them:

* **quality** on the validation split (every validation graph x machine,
  the analytic model): the plan's makespan over the best hint heuristic's,
  geometric mean and worst pair.  Validation, because this choice is a
  selection: quoting it on the test split would select on test data;
* **planning time** on the 200-op cases of
  :mod:`opsched.benchmarks.plan_speed` (3 synthetic families x 4 presets),
  pinned to one core with BLAS on one thread: median CPU milliseconds of
  ``policy.plan`` on a fresh graph copy, the hint heuristics included
  (their cache cleared before each plan), after a warm-up.

    python -m opsched.benchmarks.plan_search          # -> runs/bench/plan_search.{json,md}
    python -m opsched.benchmarks.plan_search --quick  # 3 configurations, 2 repeats
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import geomean, host_record

#: The (K samples, R refine steps, extra candidate heuristics) grid; the first is the default before issue 23.
GRID: tuple[tuple[int, int, str], ...] = (
    (1, 40, ""), (0, 20, ""), (0, 40, ""), (0, 100, ""),
    (0, 0, "cpa"), (0, 10, "cpa"), (0, 20, "cpa"), (0, 10, "cpa,bicpa"),
)
#: ``--quick``: one configuration of each kind.
QUICK_GRID = (GRID[1], GRID[4], GRID[7])
#: Plan-time scales of the hint prior whose greedy decoding is compared on validation.
PRIOR_SCALES: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0)
TIME_FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
TIME_MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100", "local")
TARGET_MS, TARGET_OPS = 100.0, 200


def validation_pairs() -> list[tuple[str, str]]:
    """(graph spec, machine spec): every validation graph on every validation machine."""
    from opsched.agents import splits

    return [(g, m) for g in splits.VALIDATION_GRAPHS for m in splits.VALIDATION_MACHINES]


def _key(k: int, r: int, extra: str) -> str:
    return f"{k},{r}" + (f",+{extra}" if extra else "")


def _candidates(policy: Any, extra: str) -> list[str]:
    """The policy's hint heuristics plus ``extra`` (comma-separated registry names)."""
    return list(policy.hints) + [x for x in extra.split(",") if x]


def quality(policy: Any, grid: Sequence[tuple[int, int, str]], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per configuration, the plans' makespans over the best hint heuristic's
    (geometric mean, worst, and per pair), under the analytic model."""
    from opsched.engine.sim import Simulator
    from opsched.policies.hints import heuristic_plans
    from opsched.specs import load_graph, load_machine

    ratios: dict[str, list[float]] = {_key(*c): [] for c in grid}
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(graph, machine, None, policy.hints).values())
        sim = Simulator(machine)
        for k, r, extra in grid:
            plan = policy.plan(graph, machine, samples=k, refine=r, candidates=_candidates(policy, extra), fill=0.0)
            ratios[_key(k, r, extra)].append(float(sim.run(graph, plan).makespan) / best)
    return {key: {"gmean": geomean(v), "worst": max(v), "ratios": v} for key, v in ratios.items()}


def greedy_by_prior(policy: Any, scales: Sequence[float], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per hint-prior scale, the greedy decoding's makespan over the best hint
    heuristic's (geometric mean, worst), under the analytic model."""
    from opsched.engine.sim import Simulator
    from opsched.policies.hints import heuristic_plans
    from opsched.specs import load_graph, load_machine

    ratios: dict[str, list[float]] = {str(x): [] for x in scales}
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(graph, machine, None, policy.hints).values())
        sim = Simulator(machine)
        for x in scales:
            plan = policy.plan(graph, machine, samples=0, candidates=(), refine=0, prior_scale=x)
            ratios[str(x)].append(sim.makespan(graph, plan) / best)
    return {key: {"gmean": geomean(v), "worst": max(v)} for key, v in ratios.items()}


def planning_ms(policy: Any, grid: Sequence[tuple[int, int, str]], repeats: int,
                families: Sequence[str] = TIME_FAMILIES) -> dict[str, Any]:
    """Per configuration, median CPU ms of planning each 200-op case, and the
    median and worst over the cases."""
    from opsched.benchmarks.plan_speed import case_ms

    out: dict[str, Any] = {}
    for k, r, extra in grid:
        names = _candidates(policy, extra)
        out[_key(k, r, extra)] = case_ms(lambda g, m, k=k, r=r, c=names: policy.plan(g, m, samples=k, refine=r,
                                                                                      candidates=c),
                                         TARGET_OPS, families, TIME_MACHINES, repeats)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.plan_search",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--repeats", type=int, default=5, help="timed plans per 200-op case and configuration")
    ap.add_argument("--quick", action="store_true", help="3 configurations, 2 prior scales, 2 repeats, 6 validation pairs, "
                                                              "one graph family timed")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder")
    args = ap.parse_args(argv)
    grid = QUICK_GRID if args.quick else GRID
    repeats = 2 if args.quick else args.repeats
    pinned = H.pin_one_core()
    folder = Path(args.policy) if args.policy else pretrained_path()
    policy = load(folder)
    pairs = validation_pairs()[:6] if args.quick else validation_pairs()
    load0 = host_record()["loadavg"]
    from opsched.policies.exported import _one_blas_thread

    with _one_blas_thread():
        q = quality(policy, grid, pairs)
        t = planning_ms(policy, grid, repeats, TIME_FAMILIES[:1] if args.quick else TIME_FAMILIES)
        prior = greedy_by_prior(policy, PRIOR_SCALES[::3] if args.quick else PRIOR_SCALES, pairs)
    current = policy.planning()
    result = {"benchmark": "plan_search", "policy": str(folder), "pairs": len(pairs), "repeats": repeats,
              "pinning": pinned, "host": host_record(), "load_before": load0,
              "default": {"samples": current["samples"], "refine": current["refine"],
                          "candidates": list(current["candidates"])},
              "configs": {key: {**q[key], **t[key]} for key in q}, "greedy_by_prior_scale": prior}
    lines = ["# Plan-time search of the exported scheduler, chosen on validation", "",
             f"Policy `{folder}`; quality on {len(pairs)} validation pairs (analytic model, makespan over the "
             f"best hint heuristic's); planning time: median CPU ms over the {len(t[next(iter(t))]['cases'])} "
             f"{TARGET_OPS}-op cases of plan_speed ({pinned}, BLAS 1 thread, {repeats} plans each). "
             f"Load average before / after: {', '.join(f'{x:.1f}' for x in load0 or ())} / "
             f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg'] or ())}. The policy's default: "
             f"K = {current['samples']}, R = {current['refine']}, candidates {', '.join(current['candidates'])}.", "",
             "| K samples | R refine | extra candidates | validation geo-mean | worst | 200-op median ms | worst ms |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for (k, r, extra), c in zip(grid, result["configs"].values(), strict=True):
        lines.append(f"| {k} | {r} | {extra or '-'} | {c['gmean']:.4f} | {c['worst']:.3f} | {c['median_ms']:.1f} | "
                     f"{c['worst_ms']:.1f} |")
    lines += ["", f"Target: a {TARGET_OPS}-op graph in at most {TARGET_MS:g} ms (median case).", "",
              f"Greedy decoding alone by plan-time scale of the hint prior (the policy's default: "
              f"x{current['prior_scale']:g}), same validation pairs:", "",
              "| prior scale | greedy geo-mean | worst |", "|---:|---:|---:|",
              *[f"| x{float(k):g} | {v['gmean']:.4f} | {v['worst']:.3f} |" for k, v in prior.items()], "",
              "Command: `python -m opsched.benchmarks.plan_search" + (" --quick" if args.quick else "") + "`", ""]
    H.save_result(Path(args.out), "plan_search", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
