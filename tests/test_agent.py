"""The graph encoder, the policy wiring, the imitation expert and the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch as th

pytest.importorskip("sb3_contrib")

from _reference import numpy_forward, numpy_params  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from opsched.agents.config import ConfigError, TrainConfig, load_hyperparams, parse_set  # noqa: E402
from opsched.agents.environments import make_env  # noqa: E402
from opsched.agents.evaluate import run_episode  # noqa: E402
from opsched.agents.policy import action_logits, greedy_action  # noqa: E402
from opsched.agents.train import build_model  # noqa: E402
from opsched.engine.layout import MAX_DEVICES, MAX_LEVELS, flatten_obs, unflatten_obs  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.synthetic import generate  # noqa: E402

th.set_num_threads(1)


def _model(env, hidden=16, rounds=2, seed=0):
    cfg = TrainConfig(hyperparams="tiny", overrides={"hidden": hidden, "rounds": rounds}).resolve()
    model = build_model(cfg, DummyVecEnv([lambda: env]), seed=seed)
    # Random, non-trivial weights everywhere (the output heads start near zero).
    g = th.Generator().manual_seed(seed)
    with th.no_grad():
        for p in model.policy.parameters():
            p.add_(0.3 * th.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def graph():
    return generate("layered", 24, 5)


@pytest.fixture(scope="module")
def machine():
    return get_machine("2x2080ti")


def _mid_episode_obs(env, steps=5, seed=0):
    """An observation with ready, running and done ops."""
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        mask = env.action_masks()
        obs, _, done, _, _ = env.step(int(rng.choice(np.flatnonzero(mask[:-1]) if mask[:-1].any()
                                                     else np.flatnonzero(mask))))
        assert not done
    return obs


def test_numpy_reference_equals_torch(graph, machine):
    env = make_env([graph], [machine], max_nodes=32)
    model = _model(env)
    obs = _mid_episode_obs(env)
    logits = action_logits(model.policy, obs)
    ref, value = numpy_forward(numpy_params(model.policy.features_extractor), obs, rounds=2)
    assert logits.shape == (32 * MAX_DEVICES * MAX_LEVELS + 1,)
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
    with th.no_grad():
        tensor, _ = model.policy.obs_to_tensor(obs)
        _, v = model.policy.features_extractor.logits_and_value(
            {k: t.float() for k, t in tensor.items()})
    assert float(v) == pytest.approx(value, rel=1e-4, abs=1e-4)


def _permute(obs, perm, n):
    """Renumber op slots: new slot k holds old slot perm[k] (only the first n are real)."""
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n)
    obs = unflatten_obs(obs, obs["node_mask"].size, obs["edge_mask"].size)
    out = {k: v.copy() for k, v in obs.items()}
    for key in ("node_static", "node_dynamic", "node_mask", "node_levels"):
        out[key][:n] = obs[key][perm]
    real = obs["edge_mask"] > 0
    out["edge_index"][:, real] = inv[obs["edge_index"][:, real]]
    return flatten_obs(out), inv


def test_encoder_is_permutation_consistent(graph, machine):
    env = make_env([graph], [machine], max_nodes=32)
    model = _model(env)
    obs = _mid_episode_obs(env, steps=6)
    n = int(obs["node_mask"].sum())
    perm = np.random.default_rng(1).permutation(n)
    pobs, inv = _permute(obs, perm, n)
    per_op = action_logits(model.policy, obs)[:-1].reshape(32, MAX_DEVICES * MAX_LEVELS)
    pper_op = action_logits(model.policy, pobs)[:-1].reshape(32, MAX_DEVICES * MAX_LEVELS)
    # old slot i is new slot inv[i]: the same scores, moved
    np.testing.assert_allclose(pper_op[inv], per_op[:n], rtol=1e-4, atol=1e-5)
    assert action_logits(model.policy, pobs)[-1] == pytest.approx(action_logits(model.policy, obs)[-1], abs=1e-5)
    # a permutation that does NOT move the edges along changes the scores (the test can fail)
    broken = dict(pobs, edge_index=obs["edge_index"])  # both flattened
    assert not np.allclose(action_logits(model.policy, broken)[:-1].reshape(32, -1)[inv], per_op[:n], atol=1e-4)


def test_same_weights_any_graph_size_and_padding(machine):
    small, big = generate("erdos_renyi", 10, 1), generate("watts_strogatz", 40, 2)
    env32 = make_env([small], [machine], max_nodes=32)
    env64 = make_env([small, big], [machine], max_nodes=64)
    m32, m64 = _model(env32), _model(env64, seed=1)
    m64.policy.load_state_dict(m32.policy.state_dict())  # no weight depends on max_nodes
    obs32, _ = env32.reset(seed=0)
    obs64, _ = env64.reset(seed=0, options={"graph": small, "machine": machine})
    l32 = action_logits(m32.policy, obs32)
    l64 = action_logits(m64.policy, obs64)
    np.testing.assert_allclose(l64[:10 * 64], l32[:10 * 64], rtol=1e-4, atol=1e-5)
    assert l64[-1] == pytest.approx(l32[-1], abs=1e-5)
    # and a 40-op graph runs to the end with greedy actions, giving a valid plan
    env64.reset(seed=0, options={"graph": big, "machine": machine})
    ret, info = run_episode(env64, lambda o, mk: greedy_action(m64.policy, o, mk))
    info["plan"].validate(big, machine)
    assert ret == pytest.approx(-info["makespan"] / info["reference"], rel=1e-6)


def test_greedy_action_matches_sb3_predict(graph, machine):
    env = make_env([graph], [machine], max_nodes=32)
    model = _model(env)
    obs = _mid_episode_obs(env)
    mask = env.action_masks()
    action, _ = model.predict(obs, action_masks=mask, deterministic=True)
    assert int(action) == greedy_action(model.policy, obs, mask)
    assert mask[int(action)]


def test_expert_replays_the_heuristic_exactly(machine):
    """Driving the env with the expert's decisions reproduces the heuristic's makespan."""
    from opsched.agents.imitation import expert_action, expert_plan
    from opsched.backends.sim import SimBackend
    from opsched.policies import get_policy

    g = generate("layered", 30, 7)
    for m in (machine, get_machine("xeon-8180-2s")):
        env = make_env([g], [m], max_nodes=32)
        env.reset(seed=0)
        ep = expert_plan(env, ["critical-path-first"])
        ret, info = run_episode(env, lambda o, mk, env=env, ep=ep: expert_action(env, ep, mk))
        expected = SimBackend(m).run(g, get_policy("critical-path-first").plan(g, m)).makespan
        assert info["makespan"] == pytest.approx(expected, rel=1e-9)
        assert ep.makespan == pytest.approx(expected, rel=1e-9)


def test_imitation_learns_the_expert_on_one_graph(machine):
    """A few epochs of cloning on one pair reach a high accuracy (the loss is wired right)."""
    from opsched.agents.imitation import warm_start

    g = generate("layered", 16, 3)
    env = make_env([g], [machine], max_nodes=16)
    model = _model(env, hidden=32, seed=2)
    hist = warm_start(model.policy, env, [(g, machine)], ["critical-path-first"], rounds=2, steps=60,
                      lr=3e-3, batch_size=64, episodes_per_round=1, seed=0)
    assert hist[-1]["accuracy"] > 0.9
    assert hist[-1]["played_return"] > -1.0  # the learner plays better than sequential


def test_config_resolution_and_errors(tmp_path):
    entry = load_hyperparams("default")
    assert entry["hidden"] == 64 and entry["rounds"] == 2
    cfg = TrainConfig(overrides=parse_set(["learning_rate=1e-4", "n_steps=64", "eval_freq=100",
                                           "validation_machines=random:2000"])).resolve()
    assert cfg.ppo["learning_rate"] == 1e-4 and cfg.ppo["n_steps"] == 64
    assert cfg.eval_freq == 100 and cfg.validation_machines == ["random:2000"]
    with pytest.raises(ConfigError, match="bogus"):
        TrainConfig(overrides={"bogus": 1}).resolve()
    with pytest.raises(ConfigError, match="n_steps"):
        TrainConfig(overrides={"n_steps": "many"}).resolve()
    with pytest.raises(ConfigError, match="also in train_machines"):
        TrainConfig(train_machines=["random:1000"]).resolve()
    with pytest.raises(ConfigError, match="not in agents/hyperparams"):
        TrainConfig(hyperparams="nope").resolve()
    assert TrainConfig(overrides={"imitation_dagger": "false"}).resolve().ppo["imitation_dagger"] is False
    with pytest.raises(ConfigError, match="true or false"):
        TrainConfig(overrides={"imitation_dagger": "maybe"}).resolve()
    # round trip through YAML
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    assert TrainConfig.load(p) == cfg


def test_level_times_are_the_models_speedups():
    """``node_levels`` = log2(t(1) / t(k)) / 7 per op and CPU level, from the performance model."""
    from opsched.engine.layout import LEVEL_KEY
    from opsched.engine.models.analytic import default_model

    g, m = generate("layered", 20, 9), get_machine("knl-68")
    env = make_env([g], [m], max_nodes=32)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    obs = unflatten_obs(obs, 32, env.unwrapped.max_edges)
    table = default_model().time_table(g, m)
    levels = m.cpu.thread_levels()
    expected = np.clip(np.log2(table.times[:, 0, :1] / table.times[:, 0, :len(levels)]) / 7, -1, 1)
    np.testing.assert_allclose(obs[LEVEL_KEY][:20, :len(levels)], expected, rtol=1e-5, atol=1e-6)
    assert not obs[LEVEL_KEY][20:].any()                       # padding
    assert obs[LEVEL_KEY][:20, 1:].max() > 0.1                 # real speed-ups, not a constant
    obs2, *_ = env.step(int(np.flatnonzero(env.action_masks())[0]))
    np.testing.assert_array_equal(obs2[LEVEL_KEY], obs[LEVEL_KEY].reshape(-1))  # static within an episode
