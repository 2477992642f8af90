"""The CP-SAT stage of the training teacher: how much faster its plans get, and what it costs.

:mod:`opsched.agents.teachers` improves the best baseline plan of each
training pair by local search; on graphs of at most
:data:`~opsched.agents.teachers.CPSAT_MAX_OPS` ops a CP-SAT stage may replace
it.  This benchmark draws random small training pairs (the train split's
synthetic graphs of at most that many ops x its machines), builds each
teacher without the stage and with it at each ``--cpsat`` deterministic
time, and reports the makespan ratio (with / without; < 1: CP-SAT helped),
how many pairs improved, and the seconds per pair (no cache).

    python -m opsched.benchmarks.teacher_cpsat           # -> runs/bench/teacher_cpsat.{json,md}
    python -m opsched.benchmarks.teacher_cpsat --pairs 6 --cpsat 0.25
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import geomean, host_record


def small_pairs(n: int, seed: int = 7) -> list[tuple[str, str]]:
    """``n`` random (graph, machine) specs of the train split with graphs of at most CPSAT_MAX_OPS ops."""
    from opsched.agents import splits
    from opsched.agents.teachers import CPSAT_MAX_OPS

    small = [g for g in splits.TRAIN_GRAPHS if not g.startswith(("zoo:", "train:"))
             and int(g.split(":")[1]) <= CPSAT_MAX_OPS]
    rng = random.Random(seed)
    return [(rng.choice(small), rng.choice(splits.TRAIN_MACHINES)) for _ in range(n)]


def measure(pairs: Sequence[tuple[str, str]], budgets: Sequence[float], max_nodes: int = 128) -> list[dict[str, Any]]:
    """Per pair: the teacher's makespan and seconds without the stage and at each budget."""
    import opsched.agents.teachers as T
    from opsched.engine.observe import prepare_episode
    from opsched.specs import load_graph, load_machine

    rows = []
    for gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        data = prepare_episode(graph, machine, None, max_nodes, 4 * max_nodes)
        row: dict[str, Any] = {"graph": gspec, "machine": mspec, "ops": len(graph.ops), "by_budget": {}}
        for budget in (0.0, *budgets):
            T._MEMORY.clear()
            t0 = time.perf_counter()
            found = T.teacher(data, cache=False, cpsat_s=budget)
            row["by_budget"][str(budget)] = {"makespan_s": found.plan.makespan, "source": found.source,
                                             "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{gspec:>28} {mspec:>10}: " + ", ".join(
            f"{b}: {row['by_budget'][str(b)]['makespan_s'] / row['by_budget']['0.0']['makespan_s']:.3f}"
            for b in budgets), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.teacher_cpsat",
                                 description=H.doc_summary(__doc__, paragraph=True))
    ap.add_argument("--pairs", type=int, default=30, help="random small training pairs")
    ap.add_argument("--cpsat", default="0.25,0.5,1.0", help="CP-SAT deterministic seconds to compare, comma-separated")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder")
    args = ap.parse_args(argv)
    budgets = [float(x) for x in args.cpsat.split(",") if x.strip()]
    load0 = host_record()["loadavg"]
    rows = measure(small_pairs(args.pairs), budgets)
    summary = {}
    for b in ("0.0", *map(str, budgets)):
        ratios = [r["by_budget"][b]["makespan_s"] / r["by_budget"]["0.0"]["makespan_s"] for r in rows]
        summary[b] = {"gmean": geomean(ratios), "best": min(ratios), "improved": sum(x < 0.999 for x in ratios),
                      "seconds_per_pair": sum(r["by_budget"][b]["seconds"] for r in rows) / len(rows)}
    result = {"benchmark": "teacher_cpsat", "pairs": len(rows), "host": host_record(), "load_before": load0,
              "summary": summary, "rows": rows}
    lines = ["# The training teacher's CP-SAT stage", "",
             f"{len(rows)} random small training pairs; teacher makespan with the stage / without "
             f"(< 1: faster), no cache. Load average before / after: "
             f"{', '.join(f'{x:.1f}' for x in load0 or ())} / "
             f"{', '.join(f'{x:.1f}' for x in result['host']['loadavg'] or ())}.", "",
             "| CP-SAT deterministic s | geo-mean | best | pairs improved | s per pair |",
             "|---:|---:|---:|---:|---:|",
             *[f"| {b if b != '0.0' else 'off'} | {s['gmean']:.4f} | {s['best']:.3f} | {s['improved']} | "
               f"{s['seconds_per_pair']:.2f} |" for b, s in summary.items()],
             "", f"Command: `python -m opsched.benchmarks.teacher_cpsat --pairs {args.pairs} --cpsat {args.cpsat}`", ""]
    H.save_result(Path(args.out), "teacher_cpsat", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
