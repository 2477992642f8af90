"""Environment speed: ScheduleEnv steps per second on one core, 100-op graphs.

Target (issue 4): >= 10,000 environment steps/s in the simulator.  What is
timed is what a training loop pays per step: ``action_masks()`` then
``step(action)`` (which builds the observation), plus ``reset()`` at episode
ends; the "agent" picks a uniformly random valid action (``flatnonzero`` on
the mask and one integer draw, a few microseconds, included).  Each case is
warmed up, then timed over several windows; the figure is the median steps
per second of this process's CPU time.

    python -m opsched.benchmarks.env_speed            # writes runs/bench/env_speed.{json,md}
    python -m opsched.benchmarks.env_speed --quick
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H

MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100")
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
TARGET = 10_000.0


def run_steps(env: Any, rng: Any, steps: int) -> int:
    """``steps`` random valid steps (resetting at episode ends); the episodes finished."""
    import numpy as np

    episodes = 0
    for _ in range(steps):
        valid = np.flatnonzero(env.action_masks())
        _, _, terminated, _, _ = env.step(int(valid[rng.integers(valid.size)]))
        if terminated:
            env.reset()
            episodes += 1
    return episodes


def main(argv: Sequence[str] | None = None) -> None:
    import numpy as np

    from opsched.envs.schedule_env import ScheduleEnv
    from opsched.machine import get_machine
    from opsched.synthetic import generate
    from opsched.timing import clocked

    args = H.throughput_args("env_speed", __doc__, argv, {"ops": 100, "max_nodes": 128, "windows": 7, "steps": 2000},
                             {"windows": 3, "steps": 500})
    pinned = H.pin_one_core()

    rows = []
    for mname in MACHINES:
        machine = get_machine(mname)
        for fam in FAMILIES:
            env = ScheduleEnv(graphs=[generate(fam, args.ops, seed) for seed in range(4)], machine=machine,
                              max_nodes=args.max_nodes)
            rng = np.random.default_rng(0)
            env.reset(seed=0)
            # one warm-up window (it also fills the per-graph caches)
            runs = clocked(lambda e=env, r=rng: run_steps(e, r, args.steps), args.windows, warmup=1)
            rate = runs.per_second(args.steps)
            steps_per_ep = args.windows * args.steps / max(sum(runs.results), 1)
            rows.append({"machine": mname, "family": fam, "ops": args.ops, "max_nodes": args.max_nodes,
                         "steps_per_s": round(rate["cpu"]), "steps_per_s_wall": round(rate["wall"]),
                         "steps_per_episode": round(steps_per_ep, 1)})
            print(f"{mname:14s} {fam:15s} {rate['cpu']:9,.0f} steps/s CPU {rate['wall']:9,.0f} wall "
                  f"({steps_per_ep:.0f} steps/episode)")
            env.close()
    H.report_throughput(
        "env_speed", "Environment speed", f"{args.ops}-op synthetic graphs, max_nodes={args.max_nodes}, one core "
        f"({pinned}); action_masks() + step() (+ reset at episode ends), random valid actions; median of "
        f"{args.windows} windows of {args.steps} steps.", rows, "steps_per_s", "steps/s", TARGET,
        {"machine": "{machine}", "family": "{family}", "steps/s (CPU)": "{steps_per_s:,}",
         "steps/s (wall)": "{steps_per_s_wall:,}", "steps/episode": "{steps_per_episode}"},
        Path(args.out), pinning=pinned, windows=args.windows, steps=args.steps)

if __name__ == "__main__":
    main()
