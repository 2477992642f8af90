"""`opsched train-policy`: run folders, resume, Ctrl-C (tiny graphs, a few hundred steps)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import typer

pytest.importorskip("sb3_contrib")

from typer.testing import CliRunner  # noqa: E402

import opsched.commands.train  # noqa: E402,F401  (registers the command)
from opsched.cli import app  # noqa: E402

TINY = [
    "--hyperparams", "tiny", "--n-envs", "2",
    "--set", "max_nodes=32",
    "--set", "train_graphs=layered:20:1,erdos_renyi:24:2",
    "--set", "train_machines=cpu:8:90:40,random:5",
    "--set", "validation_graphs=watts_strogatz:20:3",
    "--set", "validation_machines=cpu:16:80:100",
    "--set", "eval_freq=128", "--set", "checkpoint_freq=128",
]


def _train(tmp_path: Path, *args: str):
    result = CliRunner().invoke(app, ["train-policy", "--out", str(tmp_path), "--no-progress", *args],
                                catch_exceptions=False)
    return result


def test_the_command_line_is_recorded_as_typed():
    """typed_command: the options given, in their long spelling, not the defaults."""
    from opsched.cli import progress_option
    from opsched.commands.flags import typed_command

    seen = []
    demo = typer.Typer()

    @demo.command("demo")
    def demo_cmd(ctx: typer.Context, name: str = typer.Option("ppo", "--name"),
                 out: Path = typer.Option(Path("runs"), "--out", "-o"),
                 set_: list[str] = typer.Option([], "--set"), resume: Path = typer.Option(None, "--resume"),
                 progress: bool = progress_option()) -> None:
        seen.append(typed_command(ctx))

    @demo.command("other")
    def other() -> None:
        pass

    runner = CliRunner()
    assert runner.invoke(demo, ["demo", "--resume", "runs/ppo_3", "-o", "x", "--set", "a=1", "--set", "b=2",
                                "--no-progress"]).exit_code == 0
    assert runner.invoke(demo, ["demo"]).exit_code == 0
    assert seen == [["opsched", "demo", "--out", "x", "--set", "a=1", "--set", "b=2", "--resume", "runs/ppo_3",
                     "--no-progress"], ["opsched", "demo"]]


def _only_run(tmp_path: Path) -> Path:
    runs = [p for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(runs) == 1, runs
    return runs[0]


def test_tiny_run_writes_every_file(tmp_path):
    import torch

    torch.set_num_threads(2)
    result = _train(tmp_path, "--name", "tiny", "--timesteps", "256", *TINY)
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 2  # training's own thread count does not leak into the caller
    run = tmp_path / "tiny_1"
    for name in ("config.yaml", "command.txt", "versions.json", "evaluations.csv", "best_model.zip",
                 "final_model.zip", "learning_curve.png", "validation_baselines.json"):
        assert (run / name).is_file(), name
    assert "train-policy" in (run / "command.txt").read_text()
    versions = json.loads((run / "versions.json").read_text())
    assert versions["packages"]["sb3-contrib"] and versions["python"]
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    from opsched.policies import load

    assert load(run / "policy").name  # exported at the end of training, loadable with numpy only

    from opsched.agents import Run, load_trained_model

    r = Run.open(run)
    assert r.config.ppo["hidden"] == 16 and r.config.max_nodes == 32   # resolved settings saved
    steps = [c.steps for c in r.checkpoints()]
    assert steps[0] == 0 and steps[-1] == 256 and 128 in steps
    rows = r.evaluations()
    # the warm start: one imitation round, then one expert-iteration round (tiny)
    assert [row["imitation_round"] for row in rows if row["imitation_round"] >= 0] == [0, 1]
    assert [row["timesteps"] for row in rows if row["imitation_round"] < 0] == [0, 128, 256]
    assert {"gmean_cpf", "gmean_heft", "gmean_sequential", "mean_cpf", "worst_best"} <= set(rows[0])
    assert all(row[k] > 0 for row in rows for k in ("gmean_cpf", "gmean_heft", "gmean_sequential"))
    best = min(row["gmean_best"] for row in rows)
    assert json.loads((run / "summary.json").read_text())["best_score"] == pytest.approx(best)

    # TensorBoard: episode return, validation ratios against each baseline, entropy, losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("rollout/ep_rew_mean", "validation/gmean_cpf", "validation/gmean_heft", "validation/gmean_sequential",
                "train/entropy_loss", "train/value_loss", "train/policy_gradient_loss",
                "imitation/accuracy", "imitation/validation/gmean_cpf"):
        assert tag in tags, (tag, sorted(tags))

    # the best model loads (tensors only) and schedules a validation graph into a valid plan
    from opsched.agents.environments import make_env
    from opsched.agents.evaluate import policy_actor, run_episode
    from opsched.machine import get_machine
    from opsched.specs import load_graph

    model = load_trained_model(run)
    g, m = load_graph("watts_strogatz:20:3"), get_machine("knl-68")
    _, info = run_episode(make_env([g], [m], 32), policy_actor(model.policy))
    info["plan"].validate(g, m)


def test_resume_continues_the_step_counter(tmp_path):
    assert _train(tmp_path, "--name", "r", "--timesteps", "128", *TINY).exit_code == 0
    run = _only_run(tmp_path)
    result = _train(tmp_path, "--resume", str(run), "--timesteps", "384")
    assert result.exit_code == 0, result.output
    assert _only_run(tmp_path) == run                     # same folder, no new run, nothing overwritten
    from opsched.agents import Run

    r = Run.open(run)
    assert r.last_checkpoint().steps == 384
    steps = [row["timesteps"] for row in r.evaluations() if row["imitation_round"] < 0]
    assert steps[0] == 0 and steps == sorted(steps) and steps[-1] == 384 and len(set(steps)) == len(steps)
    first, again = (run / "command.txt").read_text().splitlines()
    assert first.startswith("opsched train-policy --name r --timesteps 128 --n-envs 2 --hyperparams tiny --set ")
    # the resumed run records the command as typed: the run it resumed, not a fresh run's defaults
    assert again == f"opsched train-policy --timesteps 384 --resume {run} --out {tmp_path} --no-progress"
    assert r.config.timesteps == 384
    # resuming with a setting change is refused
    bad = CliRunner().invoke(app, ["train-policy", "--resume", str(run), "--set", "n_steps=8"])
    assert bad.exit_code != 0


def test_rng_state_round_trips(tmp_path):
    """capture_rng / restore_rng: the same random numbers after a restore (torch, numpy,
    python and every env's generator)."""
    import random

    import torch as th
    from stable_baselines3.common.vec_env import DummyVecEnv

    from opsched.agents.callbacks import capture_rng, restore_rng
    from opsched.agents.config import TrainConfig
    from opsched.agents.environments import make_env
    from opsched.agents.train import build_model
    from opsched.machine import get_machine
    from opsched.synthetic import generate

    g = generate("layered", 12, 1)
    env = DummyVecEnv([lambda: make_env([g], [get_machine("cpu:8:90:40"), get_machine("knl-68")], 16)] * 2)
    model = build_model(TrainConfig(hyperparams="tiny").resolve(), env, seed=3)
    env.reset()
    state = json.loads(json.dumps(capture_rng(model)))     # through JSON, as in a checkpoint

    def draw():
        return (th.rand(3).tolist(), np.random.rand(3).tolist(), random.random(),
                [e.np_random.random() for e in (w.unwrapped for w in env.envs)])

    first = draw()
    restore_rng(model, state)
    assert draw() == first


def test_ctrl_c_leaves_a_loadable_checkpoint(tmp_path):
    code = ("import sys, opsched.commands.train; from opsched.cli import main; "
            "sys.argv = ['opsched'] + sys.argv[1:]; main()")
    args = [sys.executable, "-c", code, "train-policy", "--out", str(tmp_path), "--name", "int",
            "--timesteps", "1000000", "--no-progress", *TINY]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        run = tmp_path / "int_1"
        deadline = time.time() + 120
        while time.time() < deadline:           # wait until PPO has done an update and a checkpoint
            if (run / "checkpoints" / "step_128.json").exists():
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        else:
            pytest.fail("training never reached step 128")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "checkpoint saved" in out and "Traceback" not in out

    from opsched.agents import Run, load_trained_model

    r = Run.open(run)
    cp = r.last_checkpoint()
    assert cp.steps >= 128
    assert json.loads(cp.state_file.read_text())["num_timesteps"] == cp.steps
    model = load_trained_model(cp.model)
    assert model.policy is not None
    from opsched.agents.runs import RunLock

    with RunLock(run):  # the killed run's lock was released with its process
        pass


# ------------------------------------------------------------------ one flag vocabulary
MINE = ("train-policy", "tune", "export", "graphs", "machine", "maestro-train", "quickstart")


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_train_policy_help_says_how_long_and_lists_the_hyperparams():
    import yaml

    from opsched.agents.config import hyperparams_text

    text = _help("train-policy")
    assert re.search(r"The default run takes about \d+ minutes on 2 cores", text), text
    entries = list(yaml.safe_load(hyperparams_text()))
    assert entries and all(f"{name} (" in text for name in entries), (entries, text)
    assert "--progress --no-progress" in text and "[default: ppo]" in text and "[default: sim]" in text
    tune = _help("tune")
    assert all(f"{name} (" in tune for name in entries)


def test_one_flag_vocabulary():
    """-m is the model, -b the batch, --machine has no short flag, the performance
    model is --perf-model; progress is --progress/--no-progress; every option of
    these commands says what it does and its default."""
    from typer.main import get_command

    commands = get_command(app).commands
    assert set(MINE) <= set(commands)
    for name, command in commands.items():
        for p in command.params:
            if "-m" in p.opts:
                assert p.name == "model", (name, p.opts)
            if "-b" in p.opts:
                assert p.name == "batch", (name, p.opts)
            if "--machine" in p.opts:
                assert p.opts == ["--machine"], (name, p.opts)
            if "perf" in p.name:
                assert p.opts == ["--perf-model"], (name, p.opts)
    for name in MINE:
        params = commands[name].params
        assert not any(p.opts == ["--no-progress"] for p in params), name
        if name not in ("export", "machine"):
            assert any(p.opts == ["--progress"] and p.secondary_opts == ["--no-progress"] for p in params), name
        for p in params:
            if getattr(p, "param_type_name", "") != "option":
                continue
            assert p.help, (name, p.name)
            is_flag = getattr(p, "is_flag", False)
            assert is_flag or p.show_default is not False or "default" in p.help, (name, p.name, p.help)
    # the quickstart's real model is -m / --model like everywhere else
    assert "--model -m" in _help("quickstart")


def test_the_rl_phase_is_on_by_default_and_the_help_says_how_long():
    """Issue 23: the default run has PPO steps after the warm start; --help quotes them
    without importing torch (flags.DEFAULT_TIMESTEPS mirrors the config's)."""
    from opsched.agents.config import DEFAULT_TIMESTEPS, TrainConfig
    from opsched.agents.pretrained import PRETRAINED_SETTINGS
    from opsched.commands import flags

    assert TrainConfig().timesteps == DEFAULT_TIMESTEPS == flags.DEFAULT_TIMESTEPS > 0
    assert TrainConfig().resolve().ppo["imitation_rounds"] > 0  # the warm start comes first
    assert PRETRAINED_SETTINGS["timesteps"] == 0                # the shipped policy's recipe: warm start only
    out = CliRunner().invoke(app, ["train-policy", "--help"], env={"COLUMNS": "300"}).output
    assert f"default {DEFAULT_TIMESTEPS}" in out and f"{flags.DEFAULT_RUN_MINUTES} minutes" in out
