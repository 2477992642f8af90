"""The TensorFlow backend end to end (issue 8): ``opsched apply --backend tf``, the
environment's real mode with ``backend="tf"`` and ``opsched compare --backend tf``,
each on a tiny Keras model, with outputs checked against eager Keras.

Every TensorFlow worker process imports TensorFlow (seconds), so the tests share
one TFBackend (its workers stay up); only the tests of the registry path
(``backend="tf"`` by name, ``compare``) start their own.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

import opsched.commands.apply  # noqa: F401  (registers the command)
import opsched.commands.compare  # noqa: F401
from opsched.cli import app
from opsched.errors import OpschedError
from opsched.plan import Plan

pytestmark = pytest.mark.tf

FACTORY = '''
import keras

def build(batch):
    keras.utils.set_random_seed(0)
    x = keras.Input((12,))
    a = keras.layers.Dense(16, activation="relu")(x)
    b = keras.layers.Dense(16, activation="tanh")(x)
    y = keras.layers.Dense(4, activation="softmax")(keras.layers.Concatenate()([a, b]))
    return keras.Model(x, y, name="tinyk")
'''


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def spec(tf, tmp_path_factory):
    path = tmp_path_factory.mktemp("keras") / "tinyk.py"
    path.write_text(FACTORY)
    return f"{path}:build"


@pytest.fixture(scope="module")
def machine():
    from opsched.machine import get_machine

    return get_machine("local").cpu_only()


@pytest.fixture(scope="module")
def shared(tf, machine):
    """One TFBackend for the module: its worker processes are reused by every test."""
    from opsched.backends.tf_cpu import TFBackend

    be = TFBackend(machine, warmup=0, repeats=0, trace_runs=1)
    yield be
    be.close()
    assert not be.worker_pids()


@pytest.fixture
def use_shared(shared, monkeypatch):
    """``opsched.apply`` runs on the module's shared backend instead of the process's own."""
    import opsched.scheduled

    monkeypatch.setattr(opsched.scheduled, "shared_backend", lambda name, machine: shared)
    return shared


@pytest.fixture(scope="module")
def graph(spec):
    from opsched.specs import load_graph

    return load_graph(spec, batch=3)


# ------------------------------------------------------------------ models
def test_keras_specs_load_with_a_tf_source(spec, tf):
    from opsched.importers.tf_graph import TFSource
    from opsched.specs import load_graph, load_model, load_torch_model

    loaded = load_model(spec, batch=3)
    assert loaded.framework == "keras" and loaded.name == "build"
    g1, g2 = load_graph(spec, batch=3), load_graph(spec, batch=3)
    assert isinstance(g1.source, TFSource) and g1.source.inputs[0].shape == (3, 12)
    assert g1.fingerprint() == g2.fingerprint()  # same op ids each load: a saved plan replays
    with pytest.raises(OpschedError, match="is a Keras model, not a PyTorch one"):
        load_torch_model(spec)
    with pytest.raises(OpschedError, match="no keras.applications model 'NoSuchNet'"):
        load_graph("keras:NoSuchNet")
    with pytest.raises(OpschedError, match="unknown option.*side=N"):
        load_graph("keras:MobileNetV2:depth=3")


# ------------------------------------------------------------------- apply
def test_apply_tf_plans_runs_and_matches_keras(spec, use_shared, graph, tmp_path):
    from opsched.real_apply import run_apply

    plan_file = tmp_path / "plan.json"
    res = run_apply(spec, None, backend="tf", batch=3, repeats=2, warmup=1, save_plan=plan_file).to_dict()
    assert res["backend"] == "tf" and res["framework"] == "keras" and res["reference"] == "tf-default"
    assert [r["config"] for r in res["rows"]] == ["tf-default", "tf-recommended", "critical-path-first",
                                                  "policy (learned)"]
    for r in res["rows"]:
        assert r["outputs_equal_eager"], r
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
    assert res["rows"][0]["speedup"] == 1.0
    plan = Plan.load(plan_file)
    plan.validate(graph, use_shared.machine)
    assert plan.policy == "learned"
    again = run_apply(spec, backend="auto", batch=3, repeats=1, warmup=0, plan_file=plan_file).to_dict()
    assert again["backend"] == "tf" and again["rows"][-1]["config"] == "saved plan (learned)"
    assert all(r["outputs_equal_eager"] for r in again["rows"])


def test_apply_outputs_check_can_fail(spec, shared, graph, tf):
    """The '= eager' column compares with eager Keras: a wrong output is caught."""
    from opsched.scheduled import TF_ATOL, TF_RTOL, keras_eager, outputs_equal
    from opsched.specs import load_model

    feeds = graph.source.random_inputs(0)
    want = keras_eager(load_model(spec, batch=3).model, feeds)
    got = shared.execute_settings(graph, None, feeds)
    assert outputs_equal(got, want, TF_RTOL, TF_ATOL)
    assert not outputs_equal([got[0] * 1.01], want, TF_RTOL, TF_ATOL)
    assert not outputs_equal(shared.execute_settings(graph, None, [feeds[0] + 1.0]), want, TF_RTOL, TF_ATOL)


def test_cli_apply_tf_table_and_json(spec, use_shared, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["apply", "--backend", "tf", "--model", spec, "--policy", "critical-path-first",
                                   "--batch", "3", "--repeats", "1", "--warmup", "0", "--json", str(out)],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "tf-recommended" in res.output and "vs tf-default" in res.output
    data = json.loads(out.read_text())
    assert data["backend"] == "tf" and all(r["outputs_equal_eager"] for r in data["rows"])


def test_apply_backend_mismatch_is_a_clear_error(spec):
    runner = CliRunner()
    res = runner.invoke(app, ["apply", "--backend", "torch-cpu", "--model", spec])
    assert res.exit_code != 0 and "is a Keras model; use tf" in str(res.exception)
    res = runner.invoke(app, ["apply", "--backend", "tf", "--model", "zoo:inception", "--width", "0.25"])
    assert res.exit_code != 0 and "backend tf runs Keras models" in str(res.exception)
    res = runner.invoke(app, ["apply", "--backend", "jax", "--model", spec])
    assert res.exit_code != 0 and "unknown backend 'jax'; choose from auto, torch-cpu, torch-cuda, tf, ort" in str(res.exception)


# ---------------------------------------------------------------- env real mode
def _episode(env, seed: int = 0):
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    rewards = []
    while True:
        valid = np.flatnonzero(env.action_masks())
        obs, r, terminated, truncated, info = env.step(int(valid[rng.integers(len(valid))]))
        rewards.append(r)
        if terminated:
            return rewards, info


def test_env_real_mode_on_tf_measures_the_plan(graph, shared):
    from gymnasium.utils.env_checker import check_env

    from opsched.envs.schedule_env import ScheduleEnv

    env = ScheduleEnv(graphs=[graph], backend=shared, real_warmup=0, real_repeats=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env)
    rewards, info = _episode(env)
    assert info["measured_makespan"] > 0 and info["measured_trace"].backend == "tf"
    assert sum(rewards) == pytest.approx(-info["measured_makespan"] / info["reference"], rel=1e-9)
    assert set(info["measured_op_times"]) == {op.id for op in graph.ops}
    info["plan"].validate(graph, shared.machine)
    env.close()
    assert shared.worker_pids()  # a shared backend stays open


def test_env_real_mode_tf_by_name(graph, machine):
    import gymnasium as gym

    from opsched.envs import REAL_ENV_ID

    env = gym.make(REAL_ENV_ID, graphs=[graph], machine=machine, backend="tf", real_warmup=0, real_repeats=1)
    try:
        _, info = _episode(env.unwrapped, seed=1)
        real = env.unwrapped._real
        assert real.name == "tf" and real.trace_runs == 1 and info["measured_makespan"] > 0
        pids = real.worker_pids()
        assert pids
    finally:
        env.close()
    assert not real.worker_pids()


# ------------------------------------------------------------------- compare
def test_compare_tf_writes_its_files(spec, tmp_path):
    res = CliRunner().invoke(app, ["compare", "--model", spec, "--gantt", "all", "--backend", "tf", "--policies",
                                   "critical-path-first", "--repeats", "1", "--warmup", "0", "--batch", "3",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    run = tmp_path / "compare_1"
    rows = json.loads((run / "results.json").read_text())["results"]
    assert {r["policy"] for r in rows} == {"sequential", "critical-path-first"}
    assert all(r["backend"] == "tf" for r in rows)
    assert all(r["makespan_s"] > 0 for r in rows if r["graph"] != "geomean")
    for name in ("results.csv", "speedup.png", "command.txt"):
        assert (run / name).is_file()
    assert len(list((run / "gantt").glob("*.png"))) == 2 and len(list((run / "plans").glob("*.json"))) == 2
