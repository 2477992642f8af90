"""The RL phase's episodes: the training pairs where the student is behind its teacher, rewarded against it.

After the warm start the student imitates the best known plans of the pairs
it was taught (:mod:`opsched.agents.teachers`) but does not reach them
everywhere.  PPO over all 3,840 training pairs spends most of its episodes
where the student already matches its teacher (no advantage to learn from)
and on pairs nobody has a teacher for.  So the RL phase plays, by default,

* only taught pairs, each drawn with a weight that grows with how far the
  student's greedy plan is behind the teacher's (``rl_pairs: behind``; a
  pair within ``rl_margin`` of its teacher keeps a small weight, so what the
  student already does well is still rehearsed);
* and, with ``rl_shaping``, a return measured against the teacher: the last
  step's reward adds ``teacher makespan / reference``, so an episode's
  return is ``(teacher - makespan) / reference`` -- 0 for matching the
  teacher, > 0 for beating it -- instead of ``-makespan / reference``,
  whose scale differs by pair.  It shifts each pair's returns by a constant,
  so it changes no policy gradient in expectation, only what the critic has
  to learn (a pair's constant offset).

:class:`FocusPairs` is a Gymnasium wrapper of the ScheduleEnv the rollout
workers step; the trainer sets its pairs and weights with ``set_pairs``
(``VecEnv.env_method``) once the warm start is over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np


class FocusPairs(gym.Wrapper):
    """Draws each episode's (graph, machine) from weighted pairs; optionally
    rewards against the pair's teacher (see the module docstring).  Without
    pairs set it passes the env through unchanged."""

    def __init__(self, env: gym.Env, shaping: bool = False, teacher: Mapping[str, Any] | None = None,
                 seed: int = 0) -> None:
        from opsched.agents.teachers import TeacherSettings

        super().__init__(env)
        self.shaping = bool(shaping)
        self.teacher = TeacherSettings.from_dict(teacher)  # TeacherSettings.as_dict(), None: the defaults
        self.teacher_seed = int(seed)
        self.pairs: list[tuple[int, int]] = []
        self.weights = np.zeros(0)
        self._bonus = 0.0

    def set_pairs(self, pairs: Sequence[Sequence[int]], weights: Sequence[float] | None = None) -> None:
        """Episodes from now on: pair ``(graph index, machine index)`` of the env's
        graph and machine lists, drawn with probability proportional to its weight."""
        self.pairs = [(int(g), int(m)) for g, m in pairs]
        w = np.ones(len(self.pairs)) if weights is None else np.asarray(weights, np.float64)
        self.weights = w / w.sum() if len(w) and w.sum() > 0 else np.full(len(self.pairs), 1.0 / max(1, len(w)))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        env: Any = self.env.unwrapped  # a ScheduleEnv (its graphs, machines, episode and model)
        if self.pairs and not (options and ("graph" in options or "machine" in options)):
            if seed is not None:
                self.env.reset(seed=seed)  # seeds the env's np_random, which draws the pair
            k = int(self.np_random.choice(len(self.pairs), p=self.weights))
            g, m = self.pairs[k]
            options = {**(options or {}), "graph": env._graphs[g], "machine": env._machines[m]}
            obs, info = self.env.reset(options=options)
        else:
            obs, info = self.env.reset(seed=seed, options=options)
        self._bonus = 0.0
        if self.shaping and self.pairs:
            data = env.episode_data
            span = self.teacher.teach(data, env.model, self.teacher_seed).plan.makespan
            self._bonus = float(span) / float(data.reference)
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, step_reward, terminated, truncated, info = self.env.step(action)
        reward = float(step_reward)
        if terminated and self._bonus:
            reward += self._bonus
            info = {**info, "teacher_bonus": self._bonus}
        return obs, reward, terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        env: Any = self.env.unwrapped
        return env.action_masks()


def behind_weights(student: Sequence[float], teacher: Sequence[float], margin: float,
                   floor: float = 0.05) -> np.ndarray:
    """Per pair: how far the student is behind (``student / teacher - 1``, at
    least ``floor`` times the largest gap, and ``floor`` of it for pairs within
    ``margin``): the RL phase's draw weights."""
    gap = np.asarray(student, np.float64) / np.asarray(teacher, np.float64) - 1.0
    top = float(gap.max()) if len(gap) and gap.max() > 0 else 1.0
    w = np.where(gap > margin, gap, 0.0)
    return np.maximum(w, floor * top)


__all__ = ["FocusPairs", "behind_weights"]
