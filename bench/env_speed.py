"""Environment speed: ScheduleEnv steps per second on one core, 100-op graphs.

Target (issue 4): >= 10,000 environment steps/s in the simulator.  What is
timed is what a training loop pays per step: ``action_masks()`` then
``step(action)`` (which builds the observation), plus ``reset()`` at episode
ends; the "agent" picks a uniformly random valid action (``flatnonzero`` on
the mask and one integer draw, a few microseconds, included).  Each case is
warmed up, then timed over several windows; the figure is the median.

    python bench/env_speed.py            # writes runs/bench/env_speed.{json,md}
    python bench/env_speed.py --quick
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

from opsched.envs.schedule_env import ScheduleEnv  # noqa: E402
from opsched.io import atomic_write_text  # noqa: E402
from opsched.machine import get_machine  # noqa: E402

MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100")
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
TARGET = 10_000.0


def graphs_for(family: str, n: int, count: int) -> list:
    from opsched.synthetic import generate

    return [generate(family, n, seed) for seed in range(count)]


def run_steps(env: ScheduleEnv, rng: np.random.Generator, steps: int) -> tuple[int, int]:
    episodes = 0
    for _ in range(steps):
        valid = np.flatnonzero(env.action_masks())
        _, _, terminated, _, _ = env.step(int(valid[rng.integers(valid.size)]))
        if terminated:
            env.reset()
            episodes += 1
    return steps, episodes


def time_case(env: ScheduleEnv, windows: int, steps: int) -> tuple[float, float, float]:
    """(median steps/s by this process's CPU time, by wall time, steps per episode)."""
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    run_steps(env, rng, steps)  # warm-up (also fills the per-graph caches)
    cpu, wall, eps = [], [], 0
    for _ in range(windows):
        t0, c0 = time.perf_counter(), time.process_time()
        _, e = run_steps(env, rng, steps)
        c1, t1 = time.process_time(), time.perf_counter()
        cpu.append(steps / max(c1 - c0, 1e-9))
        wall.append(steps / (t1 - t0))
        eps += e
    return statistics.median(cpu), statistics.median(wall), windows * steps / max(eps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--max-nodes", type=int, default=128)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    if args.quick:
        args.windows, args.steps = 3, 500
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    rows = []
    for mname in MACHINES:
        machine = get_machine(mname)
        for fam in FAMILIES:
            env = ScheduleEnv(graphs=graphs_for(fam, args.ops, 4), machine=machine, max_nodes=args.max_nodes)
            rate, wall, steps_per_ep = time_case(env, args.windows, args.steps)
            rows.append({"machine": mname, "family": fam, "ops": args.ops, "max_nodes": args.max_nodes,
                         "steps_per_s": round(rate), "steps_per_s_wall": round(wall),
                         "steps_per_episode": round(steps_per_ep, 1)})
            print(f"{mname:14s} {fam:15s} {rate:9,.0f} steps/s CPU {wall:9,.0f} wall "
                  f"({steps_per_ep:.0f} steps/episode)")
            env.close()
    rates = [r["steps_per_s"] for r in rows]
    walls = [r["steps_per_s_wall"] for r in rows]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {"median_steps_per_s": round(statistics.median(rates)), "min_steps_per_s": min(rates),
               "median_steps_per_s_wall": round(statistics.median(walls)), "min_steps_per_s_wall": min(walls),
               "load_average_1min": load,
               "target_steps_per_s": TARGET, "meets_target_median": statistics.median(rates) >= TARGET,
               "meets_target_all": min(rates) >= TARGET}
    result = {"benchmark": "env_speed", "command": "python bench/env_speed.py", "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "windows": args.windows, "steps": args.steps,
              "summary": summary, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "env_speed.json", json.dumps(result, indent=1))
    lines = ["# Environment speed", "",
             f"`python bench/env_speed.py` -- {args.ops}-op synthetic graphs, max_nodes={args.max_nodes}, one core; "
             f"action_masks() + step() (+ reset at episode ends), random valid actions; median of "
             f"{args.windows} windows of {args.steps} steps.", "",
             "steps/s is steps per second of this process's CPU time (what one core delivers); the wall-clock "
             f"figure is lower when the machine is shared (1-min load average during the run: {load:.1f}).", "",
             f"**Median {summary['median_steps_per_s']:,} steps/s, minimum {summary['min_steps_per_s']:,} "
             f"steps/s** (target {TARGET:,.0f}); wall clock: median {summary['median_steps_per_s_wall']:,}, "
             f"minimum {summary['min_steps_per_s_wall']:,}.", "",
             "| machine | family | steps/s (CPU) | steps/s (wall) | steps/episode |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['machine']} | {r['family']} | {r['steps_per_s']:,} | {r['steps_per_s_wall']:,} | "
              f"{r['steps_per_episode']} |" for r in rows]
    atomic_write_text(out / "env_speed.md", "\n".join(lines) + "\n")
    print(f"median {summary['median_steps_per_s']:,} steps/s (CPU time), min {summary['min_steps_per_s']:,}; "
          f"wall median {summary['median_steps_per_s_wall']:,} "
          f"-> {out / 'env_speed.md'}")


if __name__ == "__main__":
    main()
