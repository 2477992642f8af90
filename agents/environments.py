"""Building the training environments: one ScheduleEnv per worker, vectorised.

Workers are ``SubprocVecEnv`` processes (``DummyVecEnv`` for one env or for
the real backend, whose timings must not compete for the cores).  Each worker
ignores SIGINT, so Ctrl-C reaches only the trainer, which stops at the next
step, checkpoints and closes the workers itself -- instead of every worker
dying mid-pipe with a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Sequence
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv

from opsched.envs.features import episode_level_features
from opsched.envs.spaces import LEVEL_KEY, MAX_LEVELS


class LevelTimes(gym.ObservationWrapper):
    """Adds ``node_levels``: each op's predicted speed-up at every CPU thread level.

    Why: the best thread count is where an op's time curve bottoms out (sync
    overhead grows with threads), and the env's static features give only two
    points of that curve (1 thread and all cores).  With the whole curve, the
    choice critical-path-first makes by simulating every executor split --
    the T minimising max(total work at T / cores, critical path at T) -- is a
    function of the observation.  The values come from the episode's
    simulator tables (the env's own time table of the scheduled, possibly
    coarsened, graph), so an exported scheduler computes them from the same
    performance model; see :func:`opsched.envs.features.level_features`."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        n = env.observation_space["node_mask"].shape[0]
        self.observation_space = spaces.Dict({
            **env.observation_space.spaces,
            LEVEL_KEY: spaces.Box(-1.0, 1.0, (n, MAX_LEVELS), np.float32),
        })
        self._episode: Any = None
        self._levels = np.zeros((n, MAX_LEVELS), np.float32)

    def observation(self, obs: dict) -> dict:
        data = self.env.unwrapped.episode_data  # the episode's graph, machine and simulator tables
        if data is not self._episode:
            self._levels = episode_level_features(data)
            self._episode = data
        return {**obs, LEVEL_KEY: self._levels.copy()}

    def action_masks(self) -> np.ndarray:
        return self.env.unwrapped.action_masks()


def make_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, model: Any = None,
             backend: str = "sim", level_times: bool = True) -> Any:
    """A ScheduleEnv over ``graphs`` x ``machines`` (each reset samples a pair),
    with the per-level time curve in its observation (:class:`LevelTimes`)."""
    from opsched.envs.schedule_env import ScheduleEnv

    kwargs: dict[str, Any] = dict(graphs=list(graphs), machine=list(machines), max_nodes=max_nodes, model=model)
    if backend != "sim":
        kwargs["backend"] = backend
    env = ScheduleEnv(**kwargs)
    return LevelTimes(env) if level_times else env


def _worker_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, model: Any, backend: str,
                ignore_sigint: bool, level_times: bool) -> Monitor:
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Monitor(make_env(graphs, machines, max_nodes, model, backend, level_times), info_keywords=("makespan",))


def make_vec_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, n_envs: int,
                 model: Any = None, backend: str = "sim", level_times: bool = True) -> VecEnv:
    """``n_envs`` monitored ScheduleEnvs; subprocesses when ``n_envs > 1`` in the simulator.

    Workers are forked: they inherit the loaded graphs instead of re-importing
    torch and the graph importers (seconds per worker), and they never touch
    torch themselves (the env is numpy-only in the simulator)."""
    subproc = n_envs > 1 and backend == "sim"
    fns = [partial(_worker_env, graphs, machines, max_nodes, model, backend, subproc, level_times)
           for _ in range(n_envs)]
    if not subproc:
        return DummyVecEnv(fns)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return SubprocVecEnv(fns, start_method=method)
