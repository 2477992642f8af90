"""Building the training environments: one ScheduleEnv per worker, vectorised.

Workers are ``SubprocVecEnv`` processes (``DummyVecEnv`` for one env or for
the real backend, whose timings must not compete for the cores).  Each worker
ignores SIGINT, so Ctrl-C reaches only the trainer, which stops at the next
step, checkpoints and closes the workers itself -- instead of every worker
dying mid-pipe with a KeyboardInterrupt traceback -- and asks the kernel to
end it when the trainer dies (``kill -9`` included), so no worker is orphaned.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import gymnasium as gym
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv

#: prctl(2) option: the signal a process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """End this process with SIGTERM when its parent dies (Linux; elsewhere a no-op).

    ``parent_pid``: the parent's pid as it was before this process started; if
    the parent is already gone (the race prctl cannot close), exit now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def make_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, model: Any = None,
             backend: str = "sim", hint_plan: bool = True) -> Any:
    """A ScheduleEnv over ``graphs`` x ``machines`` (each reset samples a pair);
    ``hint_plan``: the best heuristic's plan in the observation (the run's ``hint_observation``)."""
    from opsched.envs.schedule_env import ScheduleEnv

    kwargs: dict[str, Any] = dict(graphs=list(graphs), machine=list(machines), max_nodes=max_nodes, model=model,
                                  hint_plan=hint_plan)
    if backend != "sim":
        kwargs["backend"] = backend
    return ScheduleEnv(**kwargs)


def _worker_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, model: Any, backend: str,
                subprocess_worker: bool, parent_pid: int, focus: dict[str, Any] | None = None,
                hint_plan: bool = True) -> Monitor:
    if subprocess_worker:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent(parent_pid)
    env = make_env(graphs, machines, max_nodes, model, backend, hint_plan)
    if focus is not None:  # the RL phase's pairs and teacher-relative return (opsched.agents.focus)
        from opsched.agents.focus import FocusPairs

        env = FocusPairs(env, **focus)
    return Monitor(env, info_keywords=("makespan",))


def make_vec_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int, n_envs: int,
                 model: Any = None, backend: str = "sim", focus: dict[str, Any] | None = None,
                 hint_plan: bool = True) -> VecEnv:
    """``n_envs`` monitored ScheduleEnvs; subprocesses when ``n_envs > 1`` in the simulator.
    ``focus``: wrap each in :class:`~opsched.agents.focus.FocusPairs` with these arguments.

    Workers are forked: they inherit the loaded graphs instead of re-importing
    torch and the graph importers (seconds per worker), and they never touch
    torch themselves (the env is numpy-only in the simulator)."""
    subproc = n_envs > 1 and backend == "sim"
    fns: list[Callable[[], gym.Env]] = [
        partial(_worker_env, graphs, machines, max_nodes, model, backend, subproc, os.getpid(), focus, hint_plan)
        for _ in range(n_envs)]
    if not subproc:
        return DummyVecEnv(fns)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    return SubprocVecEnv(fns, start_method=method)
