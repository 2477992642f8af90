"""The fused makespan replay against the general one: planning time, interleaved.

:func:`opsched.engine.sim.replay_makespan` takes the fused loop of
:mod:`opsched.engine.fast_replay` wherever it prices the run; this benchmark
turns it off and on around each plan, in one process, on one core, so the
two are compared as ratios measured side by side on the same noisy machine.
Per case (the planning target's six 200-op graphs and two small graphs,
whose default search is mostly local-search replays), the median over
``repeats`` plans of each variant, the heuristics' cache cleared before each
plan (they are part of planning time), and a check that both variants gave
the same plan's makespan (the fused loop's makespans are the general
replay's, bit for bit, so the searches take the same steps).

    python bench/replay_speed.py              # writes runs/bench/replay_speed.{json,md}
    python bench/replay_speed.py --repeats 3  # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: (graph, machine): the planning target's cases (``opsched.benchmarks.learned``), then small graphs.
CASES: tuple[tuple[str, str], ...] = (
    *((g, m) for g in ("layered:200:911", "erdos_renyi:200:912", "watts_strogatz:200:913")
      for m in ("knl-68", "dgx1-4v100")),
    ("erdos_renyi:25:951", "cpu:4:50:10000"), ("watts_strogatz:25:955", "cpu:4:50:10000"),
    ("layered:40:960", "xeon-8180-2s"),
)


def time_case(policy: Any, graph: Any, machine: Any, repeats: int) -> dict[str, Any]:
    """Planning CPU seconds per variant (median over ``repeats``, interleaved) and both plans' makespans."""
    import opsched.engine.sim as sim
    from opsched.backends.sim import SimBackend
    from opsched.policies.hints import clear_cache

    fused = sim.supports_fast
    variants = {"fused": fused, "general": lambda s: False}
    times: dict[str, list[float]] = {k: [] for k in variants}
    spans: dict[str, float] = {}
    try:
        policy.plan(graph, machine)  # warm: time tables, the encoder
        for r in range(repeats):
            for name, gate in (variants.items() if r % 2 == 0 else reversed(variants.items())):
                sim.supports_fast = gate
                clear_cache()
                t0 = time.process_time()
                plan = policy.plan(graph, machine, seed=r)
                times[name].append(time.process_time() - t0)
                if r == 0:
                    sim.supports_fast = variants["general"]
                    spans[name] = float(SimBackend(machine).run(graph, plan).makespan)
    finally:
        sim.supports_fast = fused
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"fused_ms": med["fused"] * 1e3, "general_ms": med["general"] * 1e3,
            "ratio": med["fused"] / med["general"], "same_plan": spans["fused"] == spans["general"]}


def run(repeats: int = 5, cases: Sequence[tuple[str, str]] = CASES) -> dict[str, Any]:
    from opsched.benchmarks.harness import one_core
    from opsched.machine import get_machine
    from opsched.policies.exported import load, pretrained_path
    from opsched.specs import load_graph
    from opsched.timing import geomean, host_record

    policy = load(pretrained_path())
    load0 = os.getloadavg()
    rows = []
    with one_core() as pinned:
        for gspec, mspec in cases:
            g = load_graph(gspec)
            row = {"graph": gspec, "machine": mspec, "ops": len(g.ops),
                   **time_case(policy, g, get_machine(mspec), repeats)}
            rows.append(row)
            print(f"{gspec}@{mspec}: fused {row['fused_ms']:.1f} ms, general {row['general_ms']:.1f} ms, "
                  f"x{row['ratio']:.3f}{'' if row['same_plan'] else ' (plans differ!)'}", flush=True)
    big = [r for r in rows if r["ops"] >= 200]
    return {"rows": rows, "repeats": repeats, "pinned": pinned, "host": host_record(),
            "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
            "ratio_geomean": geomean([r["ratio"] for r in rows]),
            "planning_200_median_ms": {"fused": statistics.median(r["fused_ms"] for r in big) if big else None,
                                       "general": statistics.median(r["general_ms"] for r in big) if big else None},
            "all_same_plan": all(r["same_plan"] for r in rows)}


def markdown(res: dict[str, Any]) -> str:
    med = res["planning_200_median_ms"]
    lines = ["# Planning with the fused makespan replay", "",
             f"`python bench/replay_speed.py --repeats {res['repeats']}`: the shipped policy's default search, "
             "CPU ms per plan (one core, median over the repeats, the fused and the general replay interleaved "
             f"in one process; {res['pinned']}; load {res['load_start'][0]} -> {res['load_end'][0]}).  "
             "Same plan: both variants' plans have the same makespan (the fused loop's makespans are the "
             "general replay's bit for bit).", "",
             "| graph | machine | ops | fused ms | general ms | fused / general | same plan |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['graph']} | {r['machine']} | {r['ops']} | {r['fused_ms']:.1f} | {r['general_ms']:.1f} | "
                     f"{r['ratio']:.3f} | {'yes' if r['same_plan'] else 'NO'} |")
    if med["fused"] is not None:
        lines += ["", f"Median over the 200-op cases (issue 23's planning target, 100 ms): fused "
                  f"{med['fused']:.1f} ms, general {med['general']:.1f} ms; geometric mean of the ratios over "
                  f"every case {res['ratio_geomean']:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary, save_result

    ap = argparse.ArgumentParser(description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--repeats", type=int, default=5, help="plans per variant and case (default 5)")
    ap.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    ap.add_argument("--cases", type=int, default=0, metavar="N", help="only the first N cases (0: all)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.cases < 0:
        ap.error("--repeats must be >= 1 and --cases >= 0")
    res = run(args.repeats, CASES[:args.cases] if args.cases else CASES)
    path = save_result(Path(args.out), "replay_speed", res, markdown(res))
    print(f"wrote {path}")
    return 0 if res["all_same_plan"] else 1


__all__ = ["CASES", "main", "markdown", "run", "time_case"]
