"""The compiled makespan replay against the general one: planning time, interleaved.

:func:`opsched.engine.sim.replay_makespan` takes the loop of
:mod:`opsched.engine.fast_replay`, compiled by numba, wherever it prices the
run.  This benchmark switches between the variants around each plan, in one
process, on one core, so they are compared as ratios measured side by side
on the same noisy machine: ``compiled`` (what ships), ``general`` (every
replay through :class:`~opsched.engine.sim.SimState`: what a machine without
numba gets) and, with ``--python``, ``python`` (the same loop run as Python,
which no user gets: it is slower than the general replay).  Per case (the
planning target's six 200-op graphs and two small graphs, whose default
search is mostly local-search replays), the median over ``repeats`` plans of
each variant, the heuristics' cache cleared before each plan (they are part
of planning time; the loop is compiled before the first timing), and a check
that every variant gave the same plan's makespan (the loop's makespans are
the general replay's, bit for bit, so the searches take the same steps).

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


#: The variants timed by default, in the order of the report's columns (``python``: on request).
VARIANTS = ("compiled", "general")


def time_case(policy: Any, graph: Any, machine: Any, repeats: int,
              variants: Sequence[str] = VARIANTS) -> dict[str, Any]:
    """Planning CPU seconds per variant (median over ``repeats``, interleaved) and their plans' makespans."""
    import opsched.engine.fast_replay as fast
    import opsched.engine.sim as sim
    from opsched.backends.sim import SimBackend
    from opsched.policies.hints import clear_cache

    gate, compiled, merge = sim.supports_fast, fast._compiled, fast._compiled_merge
    setting = {"compiled": (gate, compiled, merge),
               "python": (gate, lambda: fast._loop, lambda: fast._merge_holds),
               "general": (lambda s: False, compiled, merge)}
    variants = tuple(variants)
    times: dict[str, list[float]] = {k: [] for k in variants}
    spans: dict[str, float] = {}
    try:
        policy.plan(graph, machine)  # warm: time tables, the encoder
        for r in range(repeats):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                sim.supports_fast, fast._compiled, fast._compiled_merge = setting[name]
                clear_cache()
                t0 = time.process_time()
                plan = policy.plan(graph, machine, seed=r)
                times[name].append(time.process_time() - t0)
                if r == 0:
                    sim.supports_fast = setting["general"][0]
                    spans[name] = float(SimBackend(machine).run(graph, plan).makespan)
    finally:
        sim.supports_fast, fast._compiled, fast._compiled_merge = gate, compiled, merge
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {**{f"{k}_ms": v for k, v in med.items()}, **{f"{k}_ratio": v / med["general"] for k, v in med.items()},
            "ratio": med["compiled"] / med["general"], "same_plan": len(set(spans.values())) == 1}


def run(repeats: int = 5, cases: Sequence[tuple[str, str]] = CASES, python: bool = False) -> dict[str, Any]:
    """Every case's :func:`time_case` (with ``python``: the loop run as Python too), and the summary."""
    from opsched.benchmarks.harness import one_core
    from opsched.machine import get_machine
    from opsched.policies.exported import load, pretrained_path
    from opsched.specs import load_graph
    from opsched.timing import geomean, host_record

    variants = (*VARIANTS, "python") if python else VARIANTS
    policy = load(pretrained_path())
    load0 = os.getloadavg()
    rows = []
    with one_core() as pinned:
        for gspec, mspec in cases:
            g = load_graph(gspec)
            row = {"graph": gspec, "machine": mspec, "ops": len(g.ops),
                   **time_case(policy, g, get_machine(mspec), repeats, variants)}
            rows.append(row)
            times = ", ".join(f"{k} {row[k + '_ms']:.1f} ms" for k in variants)
            print(f"{gspec}@{mspec}: {times}, x{row['ratio']:.3f}{'' if row['same_plan'] else ' (plans differ!)'}",
                  flush=True)
    big = [r for r in rows if r["ops"] >= 200]
    return {"rows": rows, "repeats": repeats, "variants": list(variants), "pinned": pinned, "host": host_record(),
            "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
            "ratio_geomean": geomean([r["ratio"] for r in rows]),
            "planning_200_median_ms": {k: statistics.median(r[f"{k}_ms"] for r in big) if big else None
                                       for k in variants},
            "all_same_plan": all(r["same_plan"] for r in rows)}


def markdown(res: dict[str, Any]) -> str:
    med, variants = res["planning_200_median_ms"], res["variants"]
    flag = " --python" if "python" in variants else ""
    lines = ["# Planning with the compiled makespan replay", "",
             f"`python bench/replay_speed.py --repeats {res['repeats']}{flag}`: the shipped policy's default "
             "search, CPU ms per plan (one core, median over the repeats, the variants interleaved in one "
             f"process; {res['pinned']}; load {res['load_start'][0]} -> {res['load_end'][0]}).  compiled: "
             "the loop of opsched/engine/fast_replay.py compiled by numba (what ships); general: every replay "
             "through SimState (what a machine without numba gets)"
             + ("; python: the compiled loop's source run as Python (no user gets it)" if flag else "")
             + ".  Same plan: every variant's plan has the same makespan (the loop's makespans are the general "
             "replay's bit for bit).", "",
             "| graph | machine | ops | " + " | ".join(f"{k} ms" for k in variants) + " | "
             + " | ".join(f"{k} / general" for k in variants if k != "general") + " | same plan |",
             "|---|---|---:|" + "---:|" * (2 * len(variants) - 1) + "---|"]
    for r in res["rows"]:
        lines.append(f"| {r['graph']} | {r['machine']} | {r['ops']} | "
                     + " | ".join(f"{r[k + '_ms']:.1f}" for k in variants) + " | "
                     + " | ".join(f"{r[k + '_ratio']:.3f}" for k in variants if k != "general")
                     + f" | {'yes' if r['same_plan'] else 'NO'} |")
    if med["compiled"] is not None:
        lines += ["", "Median over the 200-op cases (issue 23's planning target, 100 ms): "
                  + ", ".join(f"{k} {med[k]:.1f} ms" for k in variants)
                  + f"; geometric mean of compiled / general over every case {res['ratio_geomean']:.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary, save_result
    from opsched.engine.fast_replay import available

    ap = argparse.ArgumentParser(description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--repeats", type=int, default=5, help="plans per variant and case (default 5)")
    ap.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    ap.add_argument("--cases", type=int, default=0, metavar="N", help="only the first N cases (0: all)")
    ap.add_argument("--python", action="store_true", help="time the loop run as Python too")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.cases < 0:
        ap.error("--repeats must be >= 1 and --cases >= 0")
    if not available():
        ap.error("the compiled replay is not available (numba not installed, or OPSCHED_NO_JIT set)")
    res = run(args.repeats, CASES[:args.cases] if args.cases else CASES, args.python)
    path = save_result(Path(args.out), "replay_speed", res, markdown(res))
    print(f"wrote {path}")
    return 0 if res["all_same_plan"] else 1


__all__ = ["CASES", "VARIANTS", "main", "markdown", "run", "time_case"]
