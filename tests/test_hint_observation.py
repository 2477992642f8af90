"""``hint_observation``: a policy trained and planning without the best heuristic's plan in its observation.

With ``hint_observation: false`` every training, validation and plan-time
episode is prepared without the hint (the ``hint_*`` columns and ``hint_free``
are 0, so the policy's prior is off); the export records it as
``observation.hint_plan: false``, and an export without the entry (every one
written before it) plans with the hint, as before.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sb3_contrib")

from opsched.agents.config import TrainConfig  # noqa: E402
from opsched.engine.layout import DYNAMIC_FEATURES, STATIC_FEATURES, unflatten_obs  # noqa: E402
from opsched.envs.schedule_env import ScheduleEnv  # noqa: E402
from opsched.errors import PolicyError  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.policies import load  # noqa: E402
from opsched.policies.exported import DIGEST_KEY, HINT_PLAN_KEY, meta_digest, pretrained_path  # noqa: E402
from opsched.synthetic import generate  # noqa: E402

HINT_STATIC = [STATIC_FEATURES.index(k) for k in STATIC_FEATURES if k.startswith("hint_")]
HINT_FREE = DYNAMIC_FEATURES.index("hint_free")
TINY = dict(hyperparams="tiny", max_nodes=32, n_envs=1, eval_freq=64, checkpoint_freq=64,
            train_graphs=["layered:20:1", "erdos_renyi:24:2"], train_machines=["cpu:8:90:40", "dgx1-4v100"],
            validation_graphs=["watts_strogatz:20:3"], validation_machines=["cpu:16:80:100"])


def _hint_seen(env: ScheduleEnv, seed: int = 0) -> tuple[float, float]:
    """(largest |hint_*| of node_static, largest hint_free over an episode played with the first valid action)."""
    obs, _ = env.reset(seed=seed)
    o = unflatten_obs(obs, env.max_nodes, env.max_edges)
    static, free = float(np.abs(o["node_static"][:, HINT_STATIC]).max()), 0.0
    done = False
    while not done:
        free = max(free, float(unflatten_obs(obs, env.max_nodes, env.max_edges)["node_dynamic"][:, HINT_FREE].max()))
        obs, _, done, _, _ = env.step(int(np.flatnonzero(env.action_masks())[0]))
    return static, free


def test_without_the_hint_the_observation_carries_none_of_it():
    g, m = generate("layered", 24, 5), get_machine("dgx1-4v100")
    with_hint = _hint_seen(ScheduleEnv(graphs=g, machine=m, max_nodes=32))
    without = _hint_seen(ScheduleEnv(graphs=g, machine=m, max_nodes=32, hint_plan=False))
    assert with_hint[0] > 0 and with_hint[1] == 1.0  # the default: the best heuristic's plan, and its gate opens
    assert without == (0.0, 0.0)


def test_the_setting_defaults_to_the_hint_and_is_set_like_any_other():
    assert TrainConfig().resolve().hint_observation is True
    cfg = TrainConfig(overrides={"hint_observation": "false"}).resolve()
    assert cfg.hint_observation is False
    assert TrainConfig.from_dict(yaml_round_trip(cfg)).hint_observation is False


def yaml_round_trip(cfg: TrainConfig) -> dict:
    import yaml

    return yaml.safe_load(cfg.to_yaml())


def test_a_run_without_the_hint_trains_validates_exports_and_plans_without_it(tmp_path, monkeypatch):
    """Every episode of a tiny run (warm start, expert iteration, PPO, validation) and every plan of its
    exported policy is prepared with hint=None; the export says so and its greedy plan is valid."""
    import opsched.engine.observe as observe
    import opsched.envs.schedule_env as schedule_env
    import opsched.policies.exported as exported
    from opsched.agents.train import train

    monkeypatch.setenv("OPSCHED_CACHE", str(tmp_path / "cache"))
    hints: list[object] = []  # per prepared episode, the hint it was given; then every hint read in later

    def recording(real):
        def prepare(*args, **kwargs):
            hints.append(args[5] if len(args) > 5 else kwargs.get("hint"))
            return real(*args, **kwargs)
        return prepare

    real_attach = observe.attach_hint
    monkeypatch.setattr(observe, "attach_hint", lambda data, plan: hints.append(plan) or real_attach(data, plan))
    monkeypatch.setattr(schedule_env, "prepare_episode", recording(schedule_env.prepare_episode))
    run = train(TrainConfig(name="nohint", out=str(tmp_path), timesteps=64, overrides={"hint_observation": "false"},
                            **TINY), progress=False)
    assert hints and all(h is None for h in hints), f"{sum(h is not None for h in hints)} episodes had a hint"
    policy = load(run.path / "policy")
    assert policy.meta["observation"][HINT_PLAN_KEY] is False and policy.hint_plan is False
    hints.clear()
    monkeypatch.setattr(exported, "prepare_episode", recording(exported.prepare_episode))
    g, m = generate("layered", 30, 9), get_machine("knl-68")
    found = policy.plan_candidates(g, m)
    assert hints == [None]
    assert "heuristic:critical-path-first" in found  # the hint heuristics are still the default candidates
    policy.plan(g, m, samples=0, candidates=(), refine=0).validate(g, m)


def test_an_export_without_the_entry_plans_with_the_hint(tmp_path, monkeypatch):
    """An export written before the entry (the shipped one, with it removed) plans with the
    hint; true and false load as such, and a bad value is refused."""
    import opsched.engine.observe as observe

    folder = tmp_path / "p"
    folder.mkdir()
    for f in pretrained_path().iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())

    def write(value: object) -> None:
        meta = json.loads((pretrained_path() / "policy.json").read_text())
        meta["observation"].pop(HINT_PLAN_KEY, None)
        if value is not None:
            meta["observation"][HINT_PLAN_KEY] = value
        meta[DIGEST_KEY] = meta_digest({k: v for k, v in meta.items() if k != DIGEST_KEY})
        (folder / "policy.json").write_text(json.dumps(meta))

    hints: list[object] = []
    real = observe.attach_hint
    monkeypatch.setattr(observe, "attach_hint", lambda data, plan: hints.append(plan) or real(data, plan))
    g, m = generate("layered", 20, 4), get_machine("knl-68")
    write(None)
    old = load(folder)
    assert HINT_PLAN_KEY not in old.meta["observation"] and old.hint_plan is True
    old.plan(g, m, samples=0, candidates=(), refine=0)
    assert len(hints) == 1 and hints[0] is not None
    write(False)
    assert load(folder).hint_plan is False
    load(folder).plan(g, m, samples=0, candidates=(), refine=0)
    assert len(hints) == 1  # no hint read into the observation
    write(True)
    assert load(folder).hint_plan is True
    write("no")
    with pytest.raises(PolicyError, match=f"{HINT_PLAN_KEY} must be true or false"):
        load(folder)


def test_cluster_and_profiled_workers_build_their_envs_without_the_hint():
    """A Ray worker's env spec carries the setting (and a default spec is what it was before); the
    profiled machines' envs take it too."""
    from opsched.agents.profiled import make_profiled_env
    from opsched.agents.ray_vec_env import build_envs, env_spec

    g, m = generate("layered", 24, 5), get_machine("dgx1-4v100")
    assert "hint_plan" not in env_spec([g], [m], 32)
    spec = json.loads(json.dumps(env_spec([g], [m], 32, hint_plan=False)))  # as it crosses the wire
    (worker,) = build_envs(spec, 1)
    assert worker.unwrapped.hint_plan is False and _hint_seen(worker.unwrapped) == (0.0, 0.0)
    (default,) = build_envs(json.loads(json.dumps(env_spec([g], [m], 32))), 1)
    assert default.unwrapped.hint_plan is True
    profiled = make_profiled_env([g], [m], 32, {m.fingerprint(): None}, hint_plan=False)
    assert all(e.hint_plan is False for e in profiled.envs) and _hint_seen(profiled.envs[0]) == (0.0, 0.0)
