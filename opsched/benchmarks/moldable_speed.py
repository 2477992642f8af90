"""How fast CPA's allocation phase runs: biCPA's caps in one pass, against one full CPA loop per cap.

biCPA (:mod:`opsched.policies.bicpa`) runs CPA's allocation once per cap
``P'`` (every thread level of the CPU: 7-8 on a 56- or 68-core preset), and
each run recomputes the critical path after every one-level step: on a
174-op resnet50 on the 56-core Xeon, 1,775 critical-path passes in all.
:func:`opsched.policies.cpa.cpa_allocations` makes the same allocations
(tested: equal to the paper's loop for every cap) with the runs sharing their
common steps and the top and bottom levels brought up to date incrementally.
This benchmark times both on the same problems, interleaved, on one core:

* ``per_cap``: the loop as it was, one run per cap, the longest paths
  recomputed in full at every step (:func:`per_cap_allocations`);
* ``one_pass``: :func:`opsched.policies.cpa.cpa_allocations`;

and the whole heuristics (CPA, biCPA, LP rounding: allocation, list schedule
and simulation) as they now plan.  Graphs: the planning benchmark's three
200-op synthetic graphs, resnet50 at batch 8 (174 ops) and a 150-op random
graph, on the 68-core KNL and the 56-core Xeon.

    python -m opsched.benchmarks.moldable_speed           # -> runs/bench/moldable_speed.{json,md}
    python -m opsched.benchmarks.moldable_speed --quick   # two graphs on the Xeon
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import opsched.benchmarks.harness as H
from opsched.timing import host_record

GRAPHS: tuple[str, ...] = ("layered:200:911", "erdos_renyi:200:912", "watts_strogatz:200:913", "zoo:resnet50@8",
                           "erdos_renyi:150:5")
MACHINES: tuple[str, ...] = ("knl-68", "xeon-8180-2s")


def per_cap_allocations(problem: Any, caps: Sequence[int]) -> dict[int, list[int]]:
    """CPA's allocation per cap as it ran before issue 23's last stop: one loop per
    cap, the longest paths recomputed in full at every step."""
    from opsched.policies.cpa import next_level
    from opsched.policies.moldable import longest_paths

    out = {}
    levels = problem.levels
    for c in caps:
        alloc = [0] * problem.n
        cpu = [problem.is_cpu(i) for i in range(problem.n)]
        nxt = [next_level(problem, i, 0, c) if cpu[i] else None for i in range(problem.n)]
        dur = problem.durations(alloc).tolist()
        work = np.where(np.isnan(problem.fixed), levels[0] * problem.times[:, 0], 0.0)
        while any(cpu):
            top, bottom = longest_paths(problem.graph, dur)
            t_cp = float(np.max(top + bottom))
            if t_cp <= float(np.sum(work)) / c:
                break
            best, best_gain = -1, -np.inf
            for i in np.nonzero(top + bottom >= t_cp * (1.0 - 1e-12))[0]:
                b, a = nxt[i], alloc[i]
                if b is not None:
                    gain = problem.times[i, a] / levels[a] - problem.times[i, b] / levels[b]
                    if gain > best_gain:
                        best, best_gain = int(i), gain
            if best < 0:
                break
            a = nxt[best]
            assert a is not None  # best was chosen among ops with a next level
            alloc[best] = a
            t = problem.times[best, a]
            dur[best], work[best] = float(t), levels[a] * t
            nxt[best] = next_level(problem, best, a, c)
        out[c] = alloc
    return out


def _plan_fresh(name: str, graph: Any, machine: Any) -> None:
    """Heuristic ``name``'s plan of ``graph``, HEFT's shared GPU placement forgotten first."""
    from opsched.policies.moldable import clear_placements
    from opsched.policies.registry import entry

    clear_placements()
    entry(name).make().plan(graph, machine)


def _median_ms(fn: Any, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return 1e3 * statistics.median(ts)


def run(repeats: int = 5, quick: bool = False) -> dict[str, Any]:
    """Every graph on every machine: both allocation phases, and each heuristic whole."""
    from opsched.benchmarks.harness import one_core
    from opsched.engine.sim import prepare
    from opsched.machine import get_machine
    from opsched.policies.cpa import cpa_allocations
    from opsched.policies.moldable import cpu_problem
    from opsched.specs import load_graph

    rows = []
    with one_core() as pinned:
        for gspec in GRAPHS[-2:] if quick else GRAPHS:
            g = load_graph(gspec)
            for mspec in MACHINES[-1:] if quick else MACHINES:
                m = get_machine(mspec)
                problem = cpu_problem(g, m, prepare(g, m).table)
                caps = [problem.P] + [k for k in reversed(problem.levels) if k < problem.P]
                same = per_cap_allocations(problem, caps) == cpa_allocations(problem, caps)
                row: dict[str, Any] = {"graph": gspec, "machine": mspec, "ops": len(g.ops), "caps": len(caps),
                                       "same_allocations": same}
                for rep in range(2):  # interleaved: old, new, new, old
                    for tag, fn in ((("per_cap", per_cap_allocations), ("one_pass", cpa_allocations)) if rep == 0
                                    else (("one_pass", cpa_allocations), ("per_cap", per_cap_allocations))):
                        row.setdefault(f"{tag}_ms", []).append(_median_ms(partial(fn, problem, caps), repeats))
                for tag in ("per_cap", "one_pass"):
                    row[f"{tag}_ms"] = min(row[f"{tag}_ms"])
                row["speedup"] = row["per_cap_ms"] / row["one_pass_ms"]
                for name in ("cpa", "bicpa", "lp-rounding"):
                    plan = partial(_plan_fresh, name, g, m)
                    plan()
                    row[f"{name}_ms"] = _median_ms(plan, repeats)
                rows.append(row)
                print(f"{gspec} on {mspec}: biCPA's allocations {row['per_cap_ms']:.1f} -> {row['one_pass_ms']:.1f} ms "
                      f"(x{row['speedup']:.2f}), same: {same}", flush=True)
    return {"rows": rows, "pinned": pinned,
            "speedup_median": statistics.median(r["speedup"] for r in rows),
            "all_same": all(r["same_allocations"] for r in rows)}


def write_markdown(res: dict[str, Any], path: Path) -> None:
    lines = ["# CPA's allocation phase: biCPA's caps in one pass", "",
             f"`{res['command']}` on {res['host']['host']} ({res['host']['cpu_count']} CPUs), load average "
             f"{res['load_start']} -> {res['load_end']}; {res['seconds']:.0f} s; one core, CPU ms (median of "
             "repeats, the smaller of two interleaved rounds).  See `opsched.benchmarks.moldable_speed`.", "",
             f"Median speed-up of biCPA's allocations: **x{res['speedup_median']:.2f}**; the allocations equal "
             f"the per-cap loop's on every row: {res['all_same']}.", "",
             "| graph | machine | ops | caps | per cap, ms | one pass, ms | speed-up | CPA, ms | biCPA, ms | "
             "LP rounding, ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['graph']} | {r['machine']} | {r['ops']} | {r['caps']} | {r['per_cap_ms']:.1f} | "
                     f"{r['one_pass_ms']:.1f} | x{r['speedup']:.2f} | {r['cpa_ms']:.1f} | {r['bicpa_ms']:.1f} | "
                     f"{r['lp-rounding_ms']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.moldable_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    ap.add_argument("--quick", action="store_true", help="two graphs on the Xeon only")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder (default runs/bench)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0, t0 = os.getloadavg(), time.perf_counter()
    res = run(args.repeats, args.quick)
    res.update(command=" ".join(["python -m opsched.benchmarks.moldable_speed", *argv]), host=host_record(),
               load_start=[round(x, 2) for x in load0], load_end=[round(x, 2) for x in os.getloadavg()],
               seconds=time.perf_counter() - t0)
    (out / "moldable_speed.json").write_text(json.dumps(res, indent=1, default=str))
    write_markdown(res, out / "moldable_speed.md")
    print(f"wrote {out / 'moldable_speed.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
