"""Many machines on one host: a real Ray cluster on loopback (a head and a worker node pinned to one CPU,
so the two are different machines), env workers as actors, a killed worker, profiling per machine,
real rollouts placed by machine resource."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the [cluster] extra (Ray) is not installed: pip install -e '.[cluster]'")
pytest.importorskip("sb3_contrib")

from typer.testing import CliRunner  # noqa: E402

import opsched.commands.profile  # noqa: E402,F401  (registers the commands)
import opsched.commands.train  # noqa: E402,F401
from opsched.agents.cluster import machine_resource  # noqa: E402
from opsched.agents.local_cluster import LocalRayCluster, NodeSpec  # noqa: E402
from opsched.cli import app  # noqa: E402

pytestmark = pytest.mark.slow

TINY = [
    "--hyperparams", "tiny", "--set", "imitation_rounds=0", "--set", "max_nodes=32",
    "--set", "train_graphs=layered:20:1,erdos_renyi:24:2",
    "--set", "train_machines=cpu:8:90:40,random:5",
    "--set", "validation_graphs=watts_strogatz:20:3",
    "--set", "validation_machines=cpu:16:80:100",
    "--set", "eval_freq=128", "--set", "checkpoint_freq=128",
]


def _fingerprint(affinity: set[int] | None) -> str:
    from opsched.machine import Machine

    before = os.sched_getaffinity(0)
    try:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        return Machine.probe().fingerprint()
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def cluster():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: the worker node is pinned to one so that it is another machine")
    head_fp, worker_fp = _fingerprint(None), _fingerprint({0})
    c = LocalRayCluster(head_cpus=2, head_resources={machine_resource(head_fp): 1},
                        workers=[NodeSpec(cpus=1, affinity=[0], resources={machine_resource(worker_fp): 1})])
    c.start()
    c.head_fp, c.worker_fp = head_fp, worker_fp
    try:
        yield c
    finally:
        ray.shutdown()
        c.stop()


def _train(tmp_path: Path, *args: str):
    result = CliRunner().invoke(app, ["train-policy", "--out", str(tmp_path), "--no-progress", *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runs = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(runs) == 1, runs
    return runs[0]


def _evaluations(run: Path) -> list[dict[str, str]]:
    with (run / "evaluations.csv").open() as fh:
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in csv.DictReader(fh)]


def _policy_arrays(run: Path) -> dict[str, str]:
    return json.loads((run / "policy" / "policy.json").read_text())["arrays"]["sha256"]


def test_a_cluster_run_equals_a_local_run_with_the_same_seed(cluster, tmp_path):
    local = _train(tmp_path / "local", "--n-envs", "2", "--seed", "7", "--timesteps", "256", *TINY)
    remote = _train(tmp_path / "ray", "--n-envs", "2", "--seed", "7", "--timesteps", "256", *TINY,
                    "--cluster", f"ray:{cluster.address}")
    assert _evaluations(local) == _evaluations(remote) and len(_evaluations(local)) >= 3
    assert _policy_arrays(local) == _policy_arrays(remote)
    # the run folder records the cluster: nodes, CPUs, versions, where each worker ran
    record = json.loads((remote / "cluster.json").read_text())
    assert record["cluster"] == f"ray:{cluster.address}" and record["ray_version"] == ray.__version__
    assert sorted(n["address"] for n in record["nodes"]) == ["127.0.0.2", "127.0.0.3"]
    assert record["cpus_total"] == 3
    assert {cluster.head_fp, cluster.worker_fp} == {fp for n in record["nodes"] for fp in n["machines"]}
    assert len(record["workers"]) == 2 and all(w["packages"]["opsched"] for w in record["workers"])
    assert record["restarts"] == 0
    assert not (local / "cluster.json").exists()


def test_a_killed_worker_is_restarted_and_training_completes(cluster, tmp_path):
    from opsched.agents import Run, TrainConfig, train
    from opsched.agents.config import parse_set
    from opsched.agents.train import set_weights

    killed: list[int] = []

    def kill_a_worker(steps: int, row: dict) -> bool:
        if not killed and steps > 0:
            record = json.loads(next(tmp_path.glob("*/cluster.json")).read_text())
            pid = record["workers"][0]["pid"]
            os.kill(pid, signal.SIGKILL)  # the actor's process, mid-run
            killed.append(pid)
        return False

    cfg = TrainConfig(name="faulty", n_envs=2, seed=3, timesteps=512, hyperparams="tiny", out=str(tmp_path),
                      cluster=f"ray:{cluster.address}", overrides=parse_set(TINY[3::2]))
    run = train(cfg, progress=False, on_eval=kill_a_worker)
    assert killed and not run.interrupted and run.num_timesteps >= 512
    record = json.loads((run.path / "cluster.json").read_text())
    assert record["restarts"] == 1
    event = record["events"][0]
    assert event["worker"] == 0 and event["pid_before"] == killed[0] and event["pid_after"] != killed[0]
    assert record["workers"][0]["pid"] == event["pid_after"]
    # every checkpoint is complete and loads; the evaluations reach the end; the policy is exported
    cps = Run.open(run.path).checkpoints()
    assert [c.steps for c in cps][-1] == run.num_timesteps and len(cps) >= 3
    from opsched.agents.train import load_trained_model

    model = load_trained_model(run.path)
    for cp in cps:
        set_weights(model, cp.model, "checkpoint")
        assert cp.state()["num_timesteps"] == cp.steps
    assert max(float(r["timesteps"]) for r in _evaluations(run.path)) == run.num_timesteps
    assert (run.path / "policy" / "policy.json").is_file()


def test_profile_on_the_cluster_gathers_every_machine_then_trains_on_their_models(cluster, tmp_path):
    from opsched.agents.profiled import profiled_fingerprints
    from opsched.engine.profiles import load_profiles

    cache = tmp_path / "profiles"
    result = CliRunner().invoke(app, ["profile", "zoo:lstm@1x0.5", "--cluster", f"ray:{cluster.address}",
                                      "--threads", "1", "--repeats", "3", "--warmup", "1", "--no-interference",
                                      "--no-runtime", "--out", str(cache)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(profiled_fingerprints(cache)) == sorted([cluster.head_fp, cluster.worker_fp])
    profiles = {p.machine_fingerprint: p for p in load_profiles(None, cache)}
    assert set(profiles) == {cluster.head_fp, cluster.worker_fp}
    assert profiles[cluster.worker_fp].device["cores"] == 1 and profiles[cluster.head_fp].device["cores"] == 2
    assert all(min(t) > 0 for p in profiles.values() for o in p.ops.values() for t in o.samples.values())
    # a second call finds both in the cache and measures nothing
    again = CliRunner().invoke(app, ["profile", "zoo:lstm@1x0.5", "--cluster", f"ray:{cluster.address}",
                                     "--threads", "1", "--no-interference", "--no-runtime", "--out", str(cache)],
                               catch_exceptions=False)
    assert again.exit_code == 0 and again.output.count("cached") == 2, again.output

    # the env of a profiled-machine run prices machine k with machine k's fitted model
    from opsched.agents.profiled import ProfiledScheduleEnv, planning_models
    from opsched.machine import Machine
    from opsched.specs import load_graph

    machines = [Machine.from_yaml(cache / "machines" / f"{fp}.yaml") for fp in (cluster.head_fp, cluster.worker_fp)]
    models = planning_models(machines, cache)
    assert all(m.name == "fitted" for m in models.values())
    env = ProfiledScheduleEnv([load_graph("zoo:lstm@1x0.5")], machines, 64, models)
    seen = set()
    for seed in range(8):
        env.reset(seed=seed)
        fp = env.episode_data.machine.fingerprint()
        seen.add(fp)
        assert env.current.model is models[fp]
    assert seen == {cluster.head_fp, cluster.worker_fp}

    run = _train(tmp_path / "runs", "--n-envs", "2", "--timesteps", "128", *TINY, "--cluster",
                 f"ray:{cluster.address}", "--set", "profiled_machines=all", "--set", f"profiles_dir={cache}")
    from opsched.agents import Run

    cfg = Run.open(run).config
    assert sorted(Path(m).stem for m in cfg.train_machines) == sorted([cluster.head_fp, cluster.worker_fp])
    assert (run / "policy" / "policy.json").is_file()


def test_real_rollouts_run_on_a_node_of_their_machine(cluster, tmp_path):
    """--backend torch-cpu on a cluster: each worker takes its machine's resource, so it lands on a node of
    that machine (here only the pinned worker node offers it) and measures there."""
    from opsched.agents.profiled import record_machine
    from opsched.machine import Machine

    cache = tmp_path / "profiles"
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        record_machine(Machine.probe(), cache)  # the pinned node's machine, as `profile --cluster` records it
    finally:
        os.sched_setaffinity(0, before)
    run = _train(tmp_path / "runs", "--backend", "torch-cpu", "--n-envs", "1", "--timesteps", "64",
                 "--hyperparams", "tiny", "--set", "imitation_rounds=0", "--set", "max_nodes=32",
                 "--set", "n_steps=32", "--set", "train_graphs=zoo:lstm@1x0.5", "--set", "eval_freq=64",
                 "--set", "checkpoint_freq=64", "--set", "validation_graphs=watts_strogatz:20:3",
                 "--set", "validation_machines=cpu:16:80:100", "--set", f"profiles_dir={cache}",
                 "--cluster", f"ray:{cluster.address}")
    record = json.loads((run / "cluster.json").read_text())
    (worker,) = record["workers"]
    assert worker["machine"] == cluster.worker_fp and worker["node_ip"] == "127.0.0.3"
    assert np.isfinite([float(r["gmean_best"]) for r in _evaluations(run)]).all()


def test_without_ray_the_cluster_flag_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    from opsched.agents.cluster import ClusterError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    r = CliRunner().invoke(app, ["train-policy", "--out", str(tmp_path), "--cluster", "ray", *TINY])
    assert isinstance(r.exception, ClusterError)
    assert "pip install 'opsched[cluster]'" in str(r.exception) and "\n" not in str(r.exception)
    assert not any(tmp_path.iterdir())  # no half-made run folder
    r = CliRunner().invoke(app, ["train-policy", "--out", str(tmp_path), "--cluster", "spark", *TINY])
    assert isinstance(r.exception, ClusterError) and "expected ray or ray:ADDRESS" in str(r.exception)


def test_a_lost_node_s_worker_comes_back_on_another_node(cluster, tmp_path):
    """The worker node dies whole (raylet, agents, actors) mid-run: its actor is restarted on the head and
    training completes.  Runs last: the module's cluster has one node less afterwards."""
    from opsched.agents import TrainConfig, train
    from opsched.agents.config import parse_set

    lost: list[str] = []

    def kill_the_node(steps: int, row: dict) -> bool:
        if not lost and steps > 0:
            record = json.loads(next(tmp_path.glob("*/cluster.json")).read_text())
            assert sorted(w["node_ip"] for w in record["workers"]) == ["127.0.0.2", "127.0.0.3"]
            cluster.kill_node(0)
            lost.append("127.0.0.3")
        return False

    cfg = TrainConfig(name="lost", n_envs=2, seed=5, timesteps=384, hyperparams="tiny", out=str(tmp_path),
                      cluster=f"ray:{cluster.address}", overrides=parse_set(TINY[3::2]))
    run = train(cfg, progress=False, on_eval=kill_the_node)
    assert lost and not run.interrupted and run.num_timesteps >= 384
    record = json.loads((run.path / "cluster.json").read_text())
    (event,) = record["events"]
    assert event["node_before"] == "127.0.0.3" and event["node_after"] == "127.0.0.2"
    assert {w["node_ip"] for w in record["workers"]} == {"127.0.0.2"}
    assert [n["alive"] for n in record["nodes"] if n["address"] == "127.0.0.3"] == [False]
    assert (run.path / "policy" / "policy.json").is_file()
