"""Cluster speed: rollout throughput of Ray actor env workers against subprocess workers, and the learner's costs.

Targets (issue 24), on a local Ray cluster of this host (:mod:`opsched.agents.local_cluster`):

* **scaling**: 2 Ray actor workers deliver >= 1.6x the env steps/s of one
  (each worker with the same ``envs_per_worker``);
* **overhead**: Ray workers at most 15% slower than ``SubprocVecEnv`` workers
  at equal worker count (one env each, SB3's layout), and the same with
  ``envs_per_worker`` envs batched per Ray call.

What is timed is a rollout without the learner: the driver draws a random
valid action per env from the masks the VecEnv gives
(``env_method("action_masks")``), then ``step``; graphs and machines like the
default training's (synthetic DAGs of 60-120 ops, ``max_nodes`` 128, draws of
the randomized machine family).  Every configuration lives for the whole run;
the rounds are interleaved (:func:`opsched.timing.interleave`), ratios are
taken within a round, the figure is the median; the load other processes put
on the cores is recorded per round.

Then the learner, for the scaling model of ``docs/cluster.md``: the default
hyperparameters' policy inference per env step (batched over the envs), the
PPO update per sample, and one short MaskablePPO run on 2 Ray workers whose
measured steps/s is the model's single-node check.

    python -m opsched.benchmarks.cluster_speed          # runs/bench/cluster_speed.{json,md}
    python -m opsched.benchmarks.cluster_speed --quick
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H

GRAPHS = ("layered:100:1", "erdos_renyi:80:2", "watts_strogatz:120:3", "layered:60:4:mean_width=6", "ffn:60:1",
          "transformer:60:2")
MACHINES = tuple(f"random:{s}" for s in range(6))
TARGET_SCALING = 1.6
TARGET_OVERHEAD = 0.15


def rollout(env: Any, rng: Any, steps: int) -> None:
    """``steps`` vectorised steps with random valid actions."""
    import numpy as np

    for _ in range(steps):
        masks = np.stack(env.env_method("action_masks"))
        env.step(np.argmax(masks * rng.random(masks.shape), axis=1))  # a uniformly random valid action


def env_step_cost(graphs: list, machines: list, max_nodes: int, steps: int) -> float:
    """Seconds per env step in this process (no worker, no wire): the work a worker does per step."""
    import json

    import numpy as np

    from opsched.agents.ray_vec_env import EnvWorker, env_spec
    from opsched.agents.wire import unpack_arrays

    worker = EnvWorker(json.dumps(env_spec(graphs, machines, max_nodes)), 1)  # encodes as a worker does
    rng = np.random.default_rng(0)

    arrays, meta = unpack_arrays(worker.reset([0], [{}]))
    mask_len = meta["mask_len"]
    t0 = time.perf_counter()
    for _ in range(steps):
        mask = np.unpackbits(arrays["masks"], axis=1, count=mask_len).astype(bool)
        arrays, meta = unpack_arrays(worker.step([int(np.argmax(mask[0] * rng.random(mask.shape[1])))]))
    return (time.perf_counter() - t0) / steps


def learner_costs(graphs: list, machines: list, max_nodes: int, batches: Sequence[int], repeats: int) -> dict[str, Any]:
    """Seconds of the default policy's inference per batch size, and of its PPO update per sample."""
    import numpy as np
    import torch as th

    from opsched.agents.config import TrainConfig
    from opsched.agents.environments import make_vec_env
    from opsched.agents.train import build_model

    th.set_num_threads(1)
    cfg = TrainConfig(max_nodes=max_nodes).resolve()
    out: dict[str, Any] = {"inference_s_per_step": {}, "hyperparams": {k: cfg.ppo[k] for k in
                                                                      ("n_steps", "batch_size", "n_epochs", "hidden",
                                                                       "rounds")}}
    for b in batches:
        env = make_vec_env(graphs, machines, max_nodes, b)
        model = build_model(cfg, env, seed=0)
        obs = env.reset()
        assert isinstance(obs, dict)  # ScheduleEnv observes a Dict space (opsched.engine.observe)
        masks = np.stack(env.env_method("action_masks"))
        model.predict(obs, action_masks=masks)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.predict(obs, action_masks=masks)
            times.append((time.perf_counter() - t0) / b)
        out["inference_s_per_step"][str(b)] = float(np.median(times))
        env.close()
    # one PPO update (n_epochs over n_steps x n_envs samples), timed between two rollouts
    env = make_vec_env(graphs, machines, max_nodes, 2)
    model = build_model(cfg, env, seed=0)
    marks = _rollout_marks()
    n = int(cfg.ppo["n_steps"]) * 2
    model.learn(total_timesteps=2 * n, callback=marks)
    env.close()
    update_s = marks.starts[1] - marks.ends[0]
    out["update_s_per_sample"] = update_s / n
    out["rollout_s_per_step_local"] = (marks.ends[0] - marks.starts[0]) / n
    return out


def _rollout_marks() -> Any:
    """An SB3 callback recording when each rollout starts and ends (SB3 imported only when run)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class RolloutMarks(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []
            self.ends: list[float] = []

        def _on_rollout_start(self) -> None:
            self.starts.append(time.perf_counter())

        def _on_rollout_end(self) -> None:
            self.ends.append(time.perf_counter())

        def _on_step(self) -> bool:
            return True

    return RolloutMarks()


def ray_training_rate(address: str, graphs: list, machines: list, max_nodes: int, n_steps: int) -> dict[str, Any]:
    """MaskablePPO (default hyperparameters, ``n_steps`` per env) on 2 Ray workers: env steps per second of
    the whole loop (rollouts and updates), after a first rollout."""
    import torch as th

    from opsched.agents.config import TrainConfig
    from opsched.agents.train import build_model
    from opsched.agents.vec_envs import ray_vec_env

    th.set_num_threads(1)
    cfg = TrainConfig(max_nodes=max_nodes, n_envs=2, cluster=f"ray:{address}",
                      overrides={"n_steps": n_steps}).resolve()
    env = ray_vec_env(cfg, graphs, machines)
    model = build_model(cfg, env, seed=0)
    marks = _rollout_marks()
    n = n_steps * 2
    model.learn(total_timesteps=3 * n, callback=marks)
    env.close()
    seconds = time.perf_counter() - marks.starts[1]  # rollouts 2 and 3 and their updates
    rollout = sum(e - s for s, e in zip(marks.starts[1:], marks.ends[1:])) / (2 * n)
    return {"steps_per_s": 2 * n / seconds, "rollout_s_per_step": rollout, "n_steps": n_steps, "n_envs": 2,
            "note": "after the first rollout; the PPO update of the last rollout included"}


def main(argv: Sequence[str] | None = None) -> None:
    import numpy as np

    from opsched.agents.cluster import connect
    from opsched.agents.environments import make_env, make_vec_env
    from opsched.agents.local_cluster import LocalRayCluster
    from opsched.agents.ray_vec_env import RayVecEnv, env_spec
    from opsched.specs import load_graph, load_machine
    from opsched.timing import interleave

    args = H.throughput_args("cluster_speed", __doc__, argv,
                             {"steps": 300, "rounds": 7, "envs_per_worker": 8, "max_nodes": 128, "ppo_steps": 128,
                              "inline_kb": 0},
                             {"steps": 60, "rounds": 3, "ppo_steps": 32})
    graphs = [load_graph(g) for g in GRAPHS]
    machines = [load_machine(m) for m in MACHINES]
    spaces = make_env(graphs, machines, args.max_nodes)
    spec = env_spec(graphs, machines, args.max_nodes)
    E = int(args.envs_per_worker)
    # Ray runs its workers at nice 15 (its raylet and drivers first); the subprocess workers they are compared
    # with run at 0, so on a shared machine the comparison would be of priorities: both at 0 here.
    node_env = {"RAY_worker_niceness": "0"}
    if args.inline_kb:
        node_env["RAY_max_direct_call_object_size"] = str(args.inline_kb * 1024)
    with LocalRayCluster(head_cpus=8, env=node_env) as cluster:  # Ray's CPU count: one config runs at a time
        ray = connect(f"ray:{cluster.address}")
        envs: dict[str, Any] = {
            "ray_1x1": RayVecEnv(ray, spec, 1, spaces.observation_space, spaces.action_space),
            "ray_2x1": RayVecEnv(ray, spec, 2, spaces.observation_space, spaces.action_space),
            "subproc_2x1": make_vec_env(graphs, machines, args.max_nodes, 2),
            f"ray_1x{E}": RayVecEnv(ray, spec, E, spaces.observation_space, spaces.action_space, envs_per_worker=E),
            f"ray_2x{E}": RayVecEnv(ray, spec, 2 * E, spaces.observation_space, spaces.action_space,
                                    envs_per_worker=E),
        }
        rngs = {}
        for k, (name, env) in enumerate(envs.items()):
            env.seed(k)
            env.reset()
            rngs[name] = np.random.default_rng(k)
        pids = [w["pid"] for e in envs.values() if isinstance(e, RayVecEnv) for w in e.describe()["workers"]]
        pids += [p.pid for p in envs["subproc_2x1"].processes]
        from opsched.agents.local_cluster import _session_members

        pids += [pid for proc in cluster.procs for pid in _session_members(proc.pid)]

        def timed(name: str) -> Any:
            env = envs[name]

            def once() -> float:
                t0 = time.perf_counter()
                rollout(env, rngs[name], args.steps)
                return (time.perf_counter() - t0) / (args.steps * env.num_envs)  # seconds per env step
            return once

        timings = interleave({name: timed(name) for name in envs}, warmup=1, repeats=args.rounds, pids=pids)
        rates = {name: 1.0 / timings.median(name) for name in envs}
        ratio = timings.ratios("ray_1x1")
        ratio_e = timings.ratios(f"ray_1x{E}")
        ratio_sub = timings.ratios("subproc_2x1")
        for env in envs.values():
            env.close()
        training = ray_training_rate(cluster.address, graphs, machines, args.max_nodes, args.ppo_steps)
        ray.shutdown()
    learner = learner_costs(graphs, machines, args.max_nodes, (1, 2, 8, 32), repeats=20)
    learner["env_step_s_in_process"] = env_step_cost(graphs, machines, args.max_nodes, 20 * args.steps)

    scaling_1 = 1.0 / ratio["ray_2x1"]["median"]          # time per step ratio -> throughput ratio
    scaling_e = 1.0 / ratio_e[f"ray_2x{E}"]["median"]
    overhead_1 = ratio_sub["ray_2x1"]["median"] - 1.0      # Ray's time per step over subprocess's, minus 1
    overhead_e = ratio_sub[f"ray_2x{E}"]["median"] - 1.0
    summary = {
        "steps_per_s": {k: round(v) for k, v in rates.items()},
        "scaling_2_over_1_workers": {"envs_per_worker_1": round(scaling_1, 3), f"envs_per_worker_{E}": round(scaling_e, 3),
                                     "target": TARGET_SCALING},
        "ray_overhead_vs_subprocess": {"2_workers_1_env_each": round(overhead_1, 3),
                                       f"2_workers_{E}_envs_each": round(overhead_e, 3), "target": TARGET_OVERHEAD},
        "meets_scaling": max(scaling_1, scaling_e) >= TARGET_SCALING,
        "meets_overhead_equal_layout": overhead_1 <= TARGET_OVERHEAD,
        "load": timings.load_record(), "load_warning": timings.warning(),
    }
    result = {"benchmark": "cluster_speed", "command": "python -m opsched.benchmarks.cluster_speed",
              "machine": H.machine_description(), "packages": H.package_versions(), "graphs": list(GRAPHS),
              "machines": list(MACHINES), "max_nodes": args.max_nodes, "steps_per_window": args.steps,
              "rounds": args.rounds, "ray_node_env": node_env, "summary": summary, "learner": learner, "ray_training": training,
              "samples_s_per_step": timings.samples}
    lines = [
        "# Cluster speed", "",
        f"`python -m opsched.benchmarks.cluster_speed` -- rollouts with random valid actions on {len(GRAPHS)} "
        f"synthetic graphs (60-120 ops, max_nodes {args.max_nodes}) x {len(MACHINES)} random machines; "
        f"{args.rounds} interleaved rounds of {args.steps} vectorised steps; a local Ray cluster on this host "
        f"({H.describe_machine_line(result['machine'])}).", "",
        "| workers x envs each | env steps/s (median) |", "|---|---:|",
        *[f"| {k} | {v:,.0f} |" for k, v in rates.items()], "",
        f"* 2 Ray workers over 1: **x{scaling_1:.2f}** with 1 env each, **x{scaling_e:.2f}** with {E} each "
        f"(target x{TARGET_SCALING}).",
        f"* Ray over subprocess workers, 2 workers: **{overhead_1:+.0%}** time per step with 1 env each "
        f"(SB3's layout), **{overhead_e:+.0%}** with {E} envs per Ray worker (target <= +{TARGET_OVERHEAD:.0%}).",
        "* Learner (default hyperparameters, 1 torch thread): inference "
        + ", ".join(f"{float(v) * 1e6:,.0f} us/step at batch {b}" for b, v in learner["inference_s_per_step"].items())
        + f"; PPO update {learner['update_s_per_sample'] * 1e6:,.0f} us/sample; one env step in-process "
        f"(with a worker's encoding) {learner['env_step_s_in_process'] * 1e6:,.0f} us.",
        f"* MaskablePPO on 2 Ray workers (n_steps {training['n_steps']}): **{training['steps_per_s']:,.0f} env "
        f"steps/s** for the whole loop (rollout part {training['rollout_s_per_step'] * 1e6:,.0f} us/step).", "",
        f"Load: {timings.warning() or 'quiet (no round had other processes using more than a quarter core)'}; "
        f"1-min load average {timings.loadavg_start} -> {timings.loadavg_end}.", "",
        "Figures measured on a machine shared with other jobs are provisional.",
    ]
    md = H.save_result(Path(args.out), "cluster_speed", result, "\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    print(f"-> {md}")


if __name__ == "__main__":
    main()
