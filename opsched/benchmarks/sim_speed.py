"""Simulator speed: simulated ops per second on one core, 200-op graphs.

Target (issue 3): >= 50,000 simulated ops/s.  For every machine preset x graph
family x plan kind, ``SimBackend.run`` is warmed up, then timed in batches;
the figure is the median over batches of ops simulated per second of this
process's CPU time, with the whole run (plan validation, dispatch, event
loop, Trace building) included.  The time table is computed once per (graph,
machine) and cached, as in training, so its cost is reported separately
("prepare_ms").

    python -m opsched.benchmarks.sim_speed            # writes runs/bench/sim_speed.{json,md}
    python -m opsched.benchmarks.sim_speed --quick    # fewer repeats (smoke run)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H

MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100")
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
TARGET = 50_000.0


def random_plan(graph: Any, machine: Any, rng: Any) -> Any:
    """Random device, thread level and priority per op: lots of co-running."""
    from opsched.plan import Assignment, Plan

    asg = {}
    for op in graph.ops:
        dev = machine.devices[int(rng.integers(len(machine.devices)))]
        lv = dev.thread_levels()
        asg[op.id] = Assignment(dev.id, int(lv[int(rng.integers(len(lv)))]), float(rng.random()))
    return Plan.build(graph, machine, asg, policy="random")


def main(argv: Sequence[str] | None = None) -> None:
    import numpy as np

    from opsched.backends.sim import SimBackend
    from opsched.engine import sim
    from opsched.machine import get_machine
    from opsched.plan import uniform_plan
    from opsched.synthetic import generate
    from opsched.timing import clocked

    args = H.throughput_args("sim_speed", __doc__, argv, {"ops": 200, "repeats": 7, "batch": 10},
                             {"repeats": 3, "batch": 3})
    pinned = H.pin_one_core()  # one core, as the target says

    rows = []
    rng = np.random.default_rng(0)
    for mname in MACHINES:
        machine = get_machine(mname)
        backend = SimBackend(machine)
        for fam in FAMILIES:
            graph = generate(fam, args.ops, 1)
            t0 = time.perf_counter()
            sim.prepare(graph, machine, backend.model)
            prep_ms = (time.perf_counter() - t0) * 1e3
            plans = {
                "sequential": uniform_plan(graph, machine, machine.cpu.cores, policy="sequential"),
                "4-threads": uniform_plan(graph, machine, min(4, machine.cpu.cores), policy="4-threads"),
                "random": random_plan(graph, machine, rng),
            }
            for pname, plan in plans.items():
                runs = clocked(lambda b=backend, g=graph, p=plan: [b.run(g, p) for _ in range(args.batch)],
                               args.repeats, warmup=1)
                rate = runs.per_second(args.batch * len(graph.ops))
                makespan = runs.results[-1][-1].makespan
                rows.append({"machine": mname, "family": fam, "plan": pname, "ops": len(graph.ops),
                             "ops_per_s": round(rate["cpu"]), "ops_per_s_wall": round(rate["wall"]),
                             "makespan_s": makespan, "prepare_ms": round(prep_ms, 2)})
                print(f"{mname:14s} {fam:15s} {pname:11s} {rate['cpu']:10,.0f} ops/s CPU {rate['wall']:10,.0f} wall "
                      f"(makespan {makespan:.4g} s)")
    H.report_throughput(
        "sim_speed", "Simulator speed", f"{args.ops}-op graphs, one core ({pinned}), median of {args.repeats} "
        f"batches of {args.batch} runs (whole `SimBackend.run`).", rows, "ops_per_s", "ops/s", TARGET,
        {"machine": "{machine}", "family": "{family}", "plan": "{plan}", "ops/s (CPU)": "{ops_per_s:,}",
         "ops/s (wall)": "{ops_per_s_wall:,}", "makespan (s)": "{makespan_s:.4g}", "prepare (ms)": "{prepare_ms}"},
        Path(args.out), pinning=pinned, repeats=args.repeats, batch=args.batch)

if __name__ == "__main__":
    main()
