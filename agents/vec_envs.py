"""Which environments a training run gets, by its config: the one place ``train`` asks.

* ``cluster`` unset: local workers (:func:`opsched.agents.environments.make_vec_env`:
  ``SubprocVecEnv``, or ``DummyVecEnv`` for one env or a real backend);
* ``cluster: ray[:ADDRESS]``: Ray actors (:class:`~opsched.agents.ray_vec_env.RayVecEnv`),
  ``envs_per_worker`` envs each; with a real backend one worker per node,
  on a node of the machine its rollouts are for (worker ``k`` measures
  training machine ``k mod M``), through that machine's custom resource;
* ``profiled_machines`` set: the envs price each machine with its own
  planning model (:mod:`opsched.agents.profiled`), locally or on the cluster.

A cluster run records the cluster in ``<run>/cluster.json``: Ray's version,
every node with its CPUs and machines, every worker (node, pid, versions),
and each lost worker with the step it was lost at and where it came back.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv


def training_vec_env(cfg: Any, graphs: list, machines: list, run_path: Path | None = None) -> VecEnv:
    """The VecEnv ``train`` collects rollouts from (see the module docstring)."""
    from opsched.agents.environments import make_vec_env

    models = _models(cfg, machines)
    if not cfg.cluster:
        if models is None:
            return make_vec_env(graphs, machines, cfg.max_nodes, cfg.n_envs, backend=cfg.backend,
                                focus=_focus_args(cfg), hint_plan=cfg.hint_observation)
        return _local_profiled(graphs, machines, cfg.max_nodes, cfg.n_envs, models, cfg.hint_observation)
    return ray_vec_env(cfg, graphs, machines, run_path)


def focuses(cfg: Any) -> bool:
    """Whether the rollout workers can play the RL phase's chosen pairs
    (:class:`~opsched.agents.focus.FocusPairs`): simulator workers on the
    analytic model, local or Ray actors; profiled and real-backend workers play
    every training pair."""
    return (cfg.backend == "sim" and not getattr(cfg, "profiled_machines", None)
            and cfg.ppo.get("rl_pairs", "all") != "all")


def _focus_args(cfg: Any) -> dict[str, Any] | None:
    """:class:`~opsched.agents.focus.FocusPairs`' arguments, or None when the workers do not focus."""
    if not focuses(cfg):
        return None
    from opsched.agents.teachers import TeacherSettings

    return {"shaping": bool(cfg.ppo.get("rl_shaping", False)), "seed": cfg.seed,
            "teacher": TeacherSettings.from_hyperparameters(cfg.ppo).as_dict()}


def warm_start_env(cfg: Any, graphs: list, machines: list) -> Any:
    """The driver's env for the imitation warm start: the simulator, priced like the rollouts."""
    from opsched.agents.environments import make_env

    models = _models(cfg, machines)
    if models is None:
        return make_env(graphs, machines, cfg.max_nodes, backend="sim", hint_plan=cfg.hint_observation)
    from opsched.agents.profiled import make_profiled_env

    return make_profiled_env(graphs, machines, cfg.max_nodes, models, cfg.hint_observation)


def _models(cfg: Any, machines: list) -> dict[str, Any] | None:
    if not getattr(cfg, "profiled_machines", None) or cfg.backend != "sim":
        return None
    from opsched.agents.profiled import cache_dir, planning_models

    return planning_models(machines, cache_dir(cfg.profiles_dir))


def ray_vec_env(cfg: Any, graphs: list, machines: list, run_path: Path | None = None) -> VecEnv:
    """``cfg.n_envs`` envs in Ray actors on the cluster ``cfg.cluster``."""
    from opsched.agents.cluster import ClusterError, connect, describe, machine_resource, machines_offered
    from opsched.agents.environments import make_env
    from opsched.agents.ray_vec_env import RayVecEnv, env_spec

    ray = connect(cfg.cluster)
    spaces = make_env(graphs, machines, cfg.max_nodes)
    if cfg.backend == "sim":
        files = None
        if cfg.profiled_machines:
            from opsched.agents.profiled import cache_dir, model_files

            files = model_files(machines, cache_dir(cfg.profiles_dir))
        specs: Any = env_spec(graphs, machines, cfg.max_nodes, model_files=files,
                              focus=None if files else _focus_args(cfg), hint_plan=cfg.hint_observation)
        per, placed = int(cfg.envs_per_worker), None
    else:
        offered = machines_offered(ray)
        missing = [m for m in machines if m.fingerprint() not in offered]
        if missing:
            m = missing[0]
            raise ClusterError(f"no node of the cluster offers machine {m.name!r} ({machine_resource(m.fingerprint())}): "
                               "start its nodes with `ray start ... --resources \"$(python -m opsched.agents.cluster "
                               "resources)\"`")
        placed = [machines[k % len(machines)].fingerprint() for k in range(cfg.n_envs)]
        specs = [env_spec(graphs, [machines[k % len(machines)]], cfg.max_nodes, backend=cfg.backend,
                          graph_specs=list(cfg.train_graphs), hint_plan=cfg.hint_observation)
                 for k in range(cfg.n_envs)]
        per = 1  # a measured rollout has its node to itself

    def record(env: RayVecEnv) -> None:
        if run_path is not None:
            from opsched.io import atomic_write_text

            body = {"cluster": str(cfg.cluster), **describe(ray), "envs_per_worker": per, **env.describe()}
            atomic_write_text(Path(run_path) / "cluster.json", json.dumps(body, indent=2, default=str) + "\n")

    return RayVecEnv(ray, specs, cfg.n_envs, spaces.observation_space, spaces.action_space, envs_per_worker=per,
                     machines=placed, max_restarts=int(cfg.max_restarts), on_change=record)


def _profiled_worker(graphs: list, machines: list, max_nodes: int, models: dict, subprocess_worker: bool,
                     parent_pid: int, hint_plan: bool = True) -> Any:
    from stable_baselines3.common.monitor import Monitor

    from opsched.agents.environments import die_with_parent
    from opsched.agents.profiled import make_profiled_env

    if subprocess_worker:  # as opsched.agents.environments' workers: Ctrl-C reaches the trainer only
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent(parent_pid)
    return Monitor(make_profiled_env(graphs, machines, max_nodes, models, hint_plan), info_keywords=("makespan",))


def _local_profiled(graphs: list, machines: list, max_nodes: int, n_envs: int, models: dict,
                    hint_plan: bool = True) -> VecEnv:
    subproc = n_envs > 1
    fns = [partial(_profiled_worker, graphs, machines, max_nodes, models, subproc, os.getpid(), hint_plan)
           for _ in range(n_envs)]
    if not subproc:
        return DummyVecEnv(fns)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return SubprocVecEnv(fns, start_method=method)
