"""The RL phase's focused pairs and teacher-relative return (opsched.agents.focus)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sb3_contrib")

from opsched.agents.config import TrainConfig  # noqa: E402
from opsched.agents.environments import make_env  # noqa: E402
from opsched.agents.focus import FocusPairs  # noqa: E402
from opsched.agents.ray_vec_env import env_spec  # noqa: E402
from opsched.agents.teachers import TeacherSettings, teacher  # noqa: E402
from opsched.agents.vec_envs import _focus_args  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.synthetic import generate  # noqa: E402


def test_teacher_settings_come_from_the_config_once_and_reach_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSCHED_CACHE", str(tmp_path))
    cfg = TrainConfig(hyperparams="tiny", overrides={"rl_pairs": "behind", "rl_shaping": True, "teacher_steps": 30,
                                                      "teacher_cpsat_s": 0.5}).resolve()
    settings = TeacherSettings.from_hyperparameters(cfg.ppo)
    assert settings == TeacherSettings(30, 0.5)
    focus = _focus_args(cfg)
    assert focus == {"shaping": True, "seed": cfg.seed, "teacher": {"steps": 30, "cpsat_s": 0.5}}
    graphs, machines = [generate("layered", 12, 3)], [get_machine("knl-68")]
    spec = env_spec(graphs, machines, 32, focus=focus)
    assert TeacherSettings.from_dict(spec["focus"]["teacher"]) == settings  # what a Ray actor rebuilds
    assert FocusPairs(make_env(graphs, machines, 32), **spec["focus"]).teacher == settings
    assert TeacherSettings.from_dict(None) == TeacherSettings()


def test_a_shaped_episode_returns_teacher_minus_makespan_over_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("OPSCHED_CACHE", str(tmp_path))
    graphs, machines = [generate("layered", 12, 3), generate("erdos_renyi", 14, 4)], [get_machine("knl-68")]
    env = FocusPairs(make_env(graphs, machines, 32), shaping=True, teacher={"steps": 20}, seed=0)
    env.set_pairs([(1, 0)])
    obs, _ = env.reset(seed=7)
    data = env.unwrapped.episode_data
    assert data.graph is graphs[1]  # drawn from the focused pairs
    rng, total = np.random.default_rng(0), 0.0
    while True:
        obs, reward, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        total += reward
        if done:
            break
    span = teacher(data, env.unwrapped.model, 20, 0).plan.makespan
    assert info["teacher_bonus"] == pytest.approx(span / data.reference)
    assert total == pytest.approx((span - info["makespan"]) / data.reference, rel=1e-6, abs=1e-9)
