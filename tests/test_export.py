"""The exported policy (issue 7): faithful to the torch policy, numpy-only, safe to load.

A tiny MaskablePPO policy is built fresh (its weights perturbed so the logits
are decisive, as a trained policy's are), exported, and checked against the
torch policy on 1,000 states from env episodes with random valid actions; the
numpy scheduler's Plan must be exactly the Plan the environment records for
the same decisions; the loader must refuse every kind of damaged folder with
a PolicyError naming the file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sb3_contrib")

import torch as th  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from opsched.agents.config import TrainConfig  # noqa: E402
from opsched.agents.export import export_policy, export_run  # noqa: E402
from opsched.agents.policy import action_logits  # noqa: E402
from opsched.agents.train import build_model  # noqa: E402
from opsched.backends.sim import SimBackend  # noqa: E402
from opsched.engine.layout import LEVEL_KEY, PER_SLOT, unflatten_obs  # noqa: E402
from opsched.envs.schedule_env import ScheduleEnv  # noqa: E402
from opsched.errors import PolicyError  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.policies import load  # noqa: E402
from opsched.policies.exported import write_policy  # noqa: E402
from opsched.policies.numpy_encoder import greedy  # noqa: E402
from opsched.synthetic import generate  # noqa: E402

MAX_NODES = 32
MACHINES = ("xeon-8180-2s", "dgx1-4v100", "knl-68", "2x2080ti")


def _env(graphs=None, machines=MACHINES):
    """The training env (its observation has ``node_levels``; an encoder may ignore them)."""
    graphs = graphs or [generate("layered", 24, 1), generate("erdos_renyi", 30, 2), generate("watts_strogatz", 60, 3)]
    return ScheduleEnv(graphs=graphs, machine=list(machines), max_nodes=MAX_NODES)


def _sh(obs):
    """An observation of ``_env`` with its logical shapes (the env hands it over flattened)."""
    return unflatten_obs(obs, MAX_NODES, 4 * MAX_NODES)


def _episode(pol, obs):
    """The numpy encoder bound to the episode of ``obs`` (its static keys)."""
    obs = unflatten_obs(obs, pol.max_nodes, pol.max_edges)
    levels = obs[LEVEL_KEY] if pol.encoder.levels else None
    return pol.encoder.episode(obs["node_static"], obs["edge_index"], obs["edge_mask"], obs["node_mask"], levels)


@pytest.fixture(scope="module")
def model():
    th.set_num_threads(1)
    cfg = TrainConfig(hyperparams="tiny", overrides={"hidden": 16, "rounds": 2}).resolve()
    m = build_model(cfg, DummyVecEnv([_env]), seed=0)
    gen = th.Generator().manual_seed(0)
    with th.no_grad():
        for p in m.policy.parameters():
            p.add_(0.3 * th.randn(p.shape, generator=gen))
    return m


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return export_policy(model, tmp_path_factory.mktemp("exported") / "policy", machines=list(MACHINES),
                         source={"run": "test"})


def _random_states(env, n, seed=0):
    """(obs, mask) of ``n`` states along episodes driven by random valid actions."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    for _ in range(n):
        mask = env.action_masks()
        yield obs, mask
        obs, _, done, _, _ = env.step(int(rng.choice(np.flatnonzero(mask))))
        if done:
            obs, _ = env.reset()


def test_folder_layout_and_metadata(folder):
    meta = json.loads((folder / "policy.json").read_text())
    assert meta["format"] == "opsched.policy" and meta["format_version"] == 1
    assert meta["architecture"] == {"hidden": 16, "rounds": 2}
    assert meta["observation"]["max_nodes"] == MAX_NODES and meta["observation"]["max_edges"] == 4 * MAX_NODES
    assert meta["action"]["n"] == MAX_NODES * 64 + 1 and meta["machines"]["gpus"] is True
    assert meta["observation"][LEVEL_KEY] == 8 and meta["arrays"]["shapes"]["inp.weight"][1] == 25 + 8 + 8
    with np.load(folder / "weights.npz", allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(meta["arrays"]["shapes"])
        assert all(list(npz[k].shape) == s for k, s in meta["arrays"]["shapes"].items())


def test_numpy_forward_equals_torch(model, folder):
    pol = load(folder)
    for obs, _ in _random_states(_env(), 40, seed=3):
        ref = action_logits(model.policy, obs)
        mine, _ = pol.encoder.forward(obs)
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-5)


def test_faithful_on_1000_states(model, folder):
    """Deterministic actions equal the torch policy's; the only tolerated
    difference is a float32 near-tie (the torch logits of both actions within
    1e-5 of each other), and exact agreement is at least 99.5%."""
    pol = load(folder)
    env = _env()
    same, ties = 0, []
    for obs, mask in _random_states(env, 1000, seed=1):
        torch_action, _ = model.predict(obs, action_masks=mask, deterministic=True)
        valid = np.flatnonzero(mask)
        ep = _episode(pol, obs)
        scores = ep.scores(_sh(obs)["node_dynamic"], _sh(obs)["hardware"], _sh(obs)["globals"], valid, env.unwrapped.layout.wait)
        mine = int(valid[greedy(scores)])
        if mine == int(torch_action):
            same += 1
        else:
            ref = action_logits(model.policy, obs)
            ties.append(abs(float(ref[mine] - ref[int(torch_action)])))
    assert all(t <= 1e-5 for t in ties), ties
    assert same >= 995, (same, ties)


def test_factored_choices_are_the_mask_and_score_the_same(folder):
    """The planner's fast path: ``Observer.choices`` (ready ops x fitting
    columns, then wait) is exactly the flat action mask, and ``grid_scores`` on
    it gives the flat path's logits, value for value, in the same order."""
    pol = load(folder)
    env = _env([generate("erdos_renyi", 90, 5)], ["dgx1-4v100"])
    wait = env.unwrapped.layout.wait
    checked = 0
    for obs, mask in _random_states(env, 150, seed=4):
        ops, cols, can_wait = env.unwrapped._obs.choices()
        flat = [int(o) * PER_SLOT + int(c) for o in ops for c in cols] + ([wait] if can_wait else [])
        np.testing.assert_array_equal(flat, np.flatnonzero(mask))
        a, b = _episode(pol, obs), _episode(pol, obs)
        args = (_sh(obs)["node_dynamic"], _sh(obs)["hardware"], _sh(obs)["globals"])
        np.testing.assert_array_equal(a.grid_scores(*args, ops, cols, can_wait), b.scores(*args, np.array(flat), wait))
        checked += len(flat) > 1
    assert checked > 50


@pytest.mark.parametrize("graph, machine", [
    (generate("layered", 24, 4), "xeon-8180-2s"),       # fits: no coarsening
    (generate("layered", 24, 1), "knl-68"),             # fits, hinted with LP rounding (the budget's extra)
    (generate("erdos_renyi", 90, 5), "dgx1-4v100"),      # coarsened, GPUs
    (generate("watts_strogatz", 70, 6), "knl-68"),
])
@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_plan_is_the_env_episode(folder, graph, machine, scale):
    """Same decisions as the env stepped with the reference forward pass, same
    Plan; with the plan-time ``prior_scale``, the same as that forward pass with
    its hint prior scaled."""
    pol = load(folder)
    m = get_machine(machine)
    # the policy alone: its greedy decoding
    plan = pol.plan(graph, m, samples=0, candidates=(), refine=0, prior_scale=scale)
    env = _env([graph], [machine])
    obs, _ = env.reset(seed=0)
    done = False
    reference = load(folder).encoder
    reference.hint_prior = reference.hint_prior * np.float32(scale)
    while not done:
        valid = np.flatnonzero(env.action_masks())
        logits, _ = reference.forward(obs)
        obs, _, done, _, info = env.step(int(valid[greedy(logits[valid])]))
    # the plan follows the hint's plan member by member where the episode took the hinted decision
    assert dict(plan.assignments) == dict(info["plan_followed"].assignments)
    assert plan.meta["followed"] == info["plan_followed"].meta["followed"] > 0
    plan.validate(graph, m)
    if not plan.meta["coarsened"]:  # the episode's own decisions replay exactly
        assert SimBackend(m).run(graph, info["plan"]).makespan == pytest.approx(plan.meta["sim_makespan"], rel=1e-9)


def test_the_hint_holds_the_budget_extras_and_a_legacy_export_plans_without_them(folder, tmp_path):
    """A new export chooses its hint from the heuristics the default search adds for the
    graph too (LP rounding on a small graph), as training's environment does; an export
    written before ``hint_budget`` existed keeps the hint it was trained with."""
    from opsched.policies.exported import DIGEST_KEY, HINT_BUDGET_KEY, meta_digest
    from opsched.policies.hints import hint_names

    g, m = generate("layered", 24, 1), get_machine("knl-68")
    pol = load(folder)
    assert pol.hint_budget and pol.meta["observation"][HINT_BUDGET_KEY] is True
    assert pol.plan(g, m, samples=0, candidates=(), refine=0).meta["hint"] == "lp-rounding"

    def legacy(meta):
        del meta["observation"][HINT_BUDGET_KEY]
        meta[DIGEST_KEY] = meta_digest(meta)

    f = _copy(folder, tmp_path / "legacy")
    _edit_meta(f, legacy)
    old = load(f)
    assert not old.hint_budget
    alone = old.plan(g, m, samples=0, candidates=(), refine=0)
    assert alone.meta["hint"] in hint_names()
    assert "heuristic:lp-rounding" in old.plan(g, m).meta["candidates"]  # still a candidate of its search
    f2 = _copy(folder, tmp_path / "bad")
    _edit_meta(f2, lambda meta: meta["observation"].update({HINT_BUDGET_KEY: "yes"}))
    with pytest.raises(PolicyError, match="hint_budget must be true or false"):
        load(f2)


def test_validation_scores_the_plan_the_export_makes(folder):
    """Training's validation simulates the plan an export of the policy would make
    (the hint followed member by member), not the episode's slot-by-slot plan."""
    from opsched.agents.evaluate import ValidationEvaluator

    pol = load(folder)
    cfg = TrainConfig(hyperparams="tiny", overrides={"hidden": 16, "rounds": 2}, max_nodes=MAX_NODES,
                      validation_graphs=["erdos_renyi:80:3"], validation_machines=["knl-68"], train_graphs=["layered:20:1"],
                      baselines=["cpa"]).resolve()
    evaluator = ValidationEvaluator(cfg, prior_scale=1.0)
    reference = load(folder).encoder

    def act(obs, mask):
        valid = np.flatnonzero(mask)
        return int(valid[greedy(reference.forward(obs)[0][valid])])

    try:
        res = evaluator.evaluate(act)
    finally:
        evaluator.close()
    pair = evaluator.pairs[0]
    plan = pol.plan(pair.graph, pair.machine, samples=0, candidates=(), refine=0, prior_scale=1.0)
    assert plan.meta["coarsened"] and plan.meta["followed"] > 0
    assert res.makespans[pair.label] == SimBackend(pair.machine).run(pair.graph, plan).makespan


def test_incremental_embeddings_equal_a_full_pass(folder):
    """The scheduler updates embeddings by pushing changes; along whole episodes
    they stay within float32 rounding of a fresh full pass."""
    pol = load(folder)
    env = _env([generate("erdos_renyi", 90, 5), generate("layered", 30, 6)], ["dgx1-4v100", "knl-68"])
    rng = np.random.default_rng(2)
    worst, steps = 0.0, 0
    for episode in range(3):
        obs, _ = env.reset(seed=episode)
        ep = _episode(pol, obs)
        done = False
        while not done:
            dyn = _sh(obs)["node_dynamic"][: ep.n]
            fresh = _episode(pol, obs).embed(dyn)
            worst = max(worst, float(np.abs(ep.embed(dyn) - fresh).max()))
            obs, _, done, _, _ = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
            steps += 1
    assert steps >= 90 and worst < 1e-4, (steps, worst)


BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "stable_baselines3", "sb3_contrib", "gymnasium"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, Block())
""")


def test_plans_without_torch_sb3_or_gymnasium(folder, tmp_path):
    """A sitecustomize makes importing torch, SB3 and gymnasium fail; loading and planning still work."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    code = textwrap.dedent(f"""
        import sys
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker is not active")
        from opsched.machine import get_machine
        from opsched.policies import load
        from opsched.synthetic import generate
        g = generate("layered", 80, 9)
        m = get_machine("xeon-8180-2s")
        plan = load({str(folder)!r}).plan(g, m)
        plan.validate(g, m)
        bad = [k for k in ("torch", "stable_baselines3", "sb3_contrib", "gymnasium") if k in sys.modules]
        print("planned", len(plan), "ops; loaded:", bad)
    """)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "planned 80 ops; loaded: []" in out.stdout


def test_a_policy_without_node_levels_still_exports_and_plans(tmp_path):
    """Runs trained with ``level_times: false`` (and exports from before node_levels) read no levels."""
    th.set_num_threads(1)
    cfg = TrainConfig(hyperparams="tiny", level_times=False, overrides={"hidden": 8, "rounds": 1}).resolve()
    plain = build_model(cfg, DummyVecEnv([lambda: _env()]), seed=1)
    folder = export_policy(plain, tmp_path / "plain", machines=list(MACHINES))  # verifies the logits too
    meta = json.loads((folder / "policy.json").read_text())
    assert meta["observation"][LEVEL_KEY] == 0 and meta["arrays"]["shapes"]["inp.weight"] == [8, 33]
    del meta["observation"][LEVEL_KEY]  # an export from before node_levels
    (folder / "policy.json").write_text(json.dumps(meta))
    pol = load(folder)
    assert pol.encoder.levels == 0
    g, m = generate("layered", 40, 3), get_machine("knl-68")
    pol.plan(g, m).validate(g, m)
    obs, _ = _env().reset(seed=0)
    np.testing.assert_allclose(pol.encoder.forward(obs)[0], action_logits(plain.policy, obs), rtol=1e-5, atol=1e-5)


def test_export_run_from_a_run_folder(model, tmp_path):
    """``export_run`` rebuilds the model from the run's config and writes <run>/policy."""
    from opsched.agents.callbacks import save_model
    from opsched.agents.runs import Run

    cfg = TrainConfig(name="t", out=str(tmp_path), hyperparams="tiny", max_nodes=MAX_NODES,
                      overrides={"hidden": 16, "rounds": 2}, train_machines=["cpu:8:90:40", "2x2080ti"]).resolve()
    run = Run.create(cfg, argv=["test"])
    save_model(model, run.best_model)
    out = export_run(run.path)
    assert out == run.path / "policy"
    pol = load(run.path)  # a run folder holding policy/ is accepted too
    assert pol.meta["source"]["model"] == "best_model.zip" and pol.meta["machines"]["gpus"] is True
    obs, _ = next(_random_states(_env(), 1))
    np.testing.assert_allclose(pol.encoder.forward(obs)[0], action_logits(model.policy, obs), rtol=1e-5, atol=1e-5)
    with pytest.raises(PolicyError, match="final_model.zip: no such file"):
        export_run(run.path, which="final")
    # the command line does the same
    from typer.testing import CliRunner

    import opsched.commands.export  # noqa: F401  (registers the command)
    from opsched.cli import app

    res = CliRunner().invoke(app, ["export", str(run.path), "--out", str(tmp_path / "cli_policy"), "--no-verify"])
    assert res.exit_code == 0, res.output
    assert "exported best_model.zip" in res.output and load(tmp_path / "cli_policy").meta["arrays"] == pol.meta["arrays"]


# ------------------------------------------------------------------ safety
def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_meta(folder: Path, fn) -> None:
    meta = json.loads((folder / "policy.json").read_text())
    fn(meta)
    (folder / "policy.json").write_text(json.dumps(meta))


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    with np.load(folder / "weights.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def test_missing_files(folder, tmp_path):
    with pytest.raises(PolicyError, match=r"nowhere.*no such file"):
        load(tmp_path / "nowhere")
    f = _copy(folder, tmp_path / "p")
    (f / "weights.npz").unlink()
    with pytest.raises(PolicyError, match=r"weights\.npz: no such file"):
        load(f)


def test_truncated_or_corrupt_archive(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    data = (f / "weights.npz").read_bytes()
    (f / "weights.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(PolicyError, match=r"weights\.npz: truncated or corrupt"):
        load(f)
    (f / "weights.npz").write_bytes(b"not a zip at all")
    with pytest.raises(PolicyError, match=r"weights\.npz: truncated or corrupt"):
        load(f)


def test_truncated_json_and_unknown_version(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    text = (f / "policy.json").read_text()
    (f / "policy.json").write_text(text[: len(text) // 3])
    with pytest.raises(PolicyError, match=r"policy\.json: not valid JSON"):
        load(f)
    (f / "policy.json").write_text(text)
    _edit_meta(f, lambda m: m.update(format_version=99))
    with pytest.raises(PolicyError, match=r"policy\.json: unknown policy format version 99"):
        load(f)


def test_hash_mismatch(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    arrays = _arrays(f)
    arrays["act.bias"] = arrays["act.bias"] + 1.0
    np.savez(f / "weights.npz", **arrays)
    with pytest.raises(PolicyError, match=r"weights\.npz: array 'act\.bias' does not match its sha256"):
        load(f)


def test_shape_mismatch(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    arrays = _arrays(f)
    arrays["wait.weight"] = np.zeros((1, 17), np.float32)
    np.savez(f / "weights.npz", **arrays)
    with pytest.raises(PolicyError, match=r"weights\.npz: array 'wait\.weight' is float32 \(1, 17\), declared"):
        load(f)
    g = _copy(folder, tmp_path / "q")
    _edit_meta(g, lambda m: m["arrays"]["shapes"].update({"wait.weight": [1, 17]}))
    with pytest.raises(PolicyError, match=r"policy\.json: declared array shapes do not fit"):
        load(g)


def test_pickled_objects_are_refused_and_never_run(folder, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    f = _copy(folder, tmp_path / "p")
    arrays = _arrays(f)
    obj = np.empty(1, dtype=object)
    obj[0] = Payload()
    arrays["act.bias"] = obj
    np.savez(f / "weights.npz", **arrays)  # np.savez pickles object arrays
    with pytest.raises(PolicyError, match=r"weights\.npz: array 'act\.bias' holds pickled Python objects"):
        load(f)
    assert not marker.exists()


def test_unexpected_members_and_paths(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    with zipfile.ZipFile(f / "weights.npz", "a") as zf:
        zf.writestr("extra.npy", b"\x93NUMPY")
    with pytest.raises(PolicyError, match=r"weights\.npz: the archive's members do not match"):
        load(f)
    g = _copy(folder, tmp_path / "q")
    _edit_meta(g, lambda m: m["arrays"].update(file="../../etc/passwd"))
    with pytest.raises(PolicyError, match=r"policy\.json: the weights file must be a plain file name"):
        load(g)


def test_another_observation_layout(folder, tmp_path):
    f = _copy(folder, tmp_path / "p")
    _edit_meta(f, lambda m: m["observation"]["static_features"].pop())
    with pytest.raises(PolicyError, match=r"policy\.json: made for another observation layout"):
        load(f)


def test_cannot_plan_is_a_policy_error(folder, tmp_path):
    arrays = _arrays(folder)
    small = write_policy(tmp_path / "small", arrays, hidden=16, rounds=2, max_nodes=MAX_NODES, max_graph_ops=40)
    with pytest.raises(PolicyError, match="has 60 ops; this policy plans at most 40"):
        load(small).plan(generate("layered", 60, 1), get_machine("xeon-8180-2s"))
    cpu_only = write_policy(tmp_path / "cpu", arrays, hidden=16, rounds=2, max_nodes=MAX_NODES,
                            machines=["cpu:8:90:40"], gpus=False)
    with pytest.raises(PolicyError, match="trained on CPU-only machines"):
        load(cpu_only).plan(generate("layered", 20, 1), get_machine("dgx1-4v100"))


def test_every_entry_of_policy_json_is_covered_by_its_digest(folder, tmp_path):
    """Issue 17: sizes such as max_nodes and max_edges change the plans as much as the
    weights do; policy.json carries the sha256 of its canonical content, and an
    edited entry is refused (tests/test_validation.py edits every entry in turn)."""
    from opsched.policies.exported import DIGEST_KEY, meta_digest

    meta = json.loads((folder / "policy.json").read_text())
    assert meta[DIGEST_KEY] == meta_digest(meta)
    for key, value in (("max_nodes", 2 * MAX_NODES), ("max_edges", 4 * MAX_NODES + 1)):
        f = _copy(folder, tmp_path / key)
        _edit_meta(f, lambda m, key=key, value=value: m["observation"].update({key: value}))
        with pytest.raises(PolicyError, match=rf"policy\.json: the content does not match its {DIGEST_KEY}"):
            load(f)


def test_validation_scores_the_prior_scale_that_ships(model, folder):
    """Inside ``hint_prior_scaled`` the torch policy's logits are the numpy
    scheduler's at that plan-time ``prior_scale`` (so validation picks the best
    model on the decoding that ships), and the trained weights come back after,
    also when the block raises."""
    from opsched.agents.policy import hint_prior_scaled

    pol = load(folder)
    before = model.policy.features_extractor.hint_prior.detach().clone()
    assert before.abs().sum() > 0
    states = list(_random_states(_env(), 12, seed=5))
    unscaled = pol.encoder.hint_prior
    try:
        pol.encoder.hint_prior = unscaled * np.float32(10.0)
        plain = [action_logits(model.policy, obs) for obs, _ in states]
        with hint_prior_scaled(model.policy, 10.0):
            scaled = [action_logits(model.policy, obs) for obs, _ in states]
            for (obs, _), logits in zip(states, scaled):
                np.testing.assert_allclose(pol.encoder.forward(obs)[0], logits, rtol=1e-5, atol=1e-4)
        assert any(not np.allclose(a, b) for a, b in zip(plain, scaled))  # the hint bonus did change
    finally:
        pol.encoder.hint_prior = unscaled
    assert th.equal(model.policy.features_extractor.hint_prior, before)
    with pytest.raises(KeyboardInterrupt), hint_prior_scaled(model.policy, 10.0):
        assert not th.equal(model.policy.features_extractor.hint_prior, before)
        raise KeyboardInterrupt
    assert th.equal(model.policy.features_extractor.hint_prior, before)
    obs = states[0][0]
    np.testing.assert_allclose(pol.encoder.forward(obs)[0], action_logits(model.policy, obs), rtol=1e-5, atol=1e-5)
