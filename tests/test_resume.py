"""Ctrl-C in any phase of `opsched train-policy`, then --resume: the run continues that phase.

The defect this pins (issue 23): a Ctrl-C during the imitation warm start left
a step-0 checkpoint of a half-trained policy; ``--resume`` then skipped the
warm start, ran zero PPO steps and exported that policy without a word.  Each
test stops a tiny run in one phase -- through ``TrainState.stop_when``, the
hook every Ctrl-C check asks (the CLI test sends a real SIGINT) -- resumes
it, and compares with the same run uninterrupted: the warm start resumes
exactly (same weights, same evaluations), the RL phase continues its step
counter to the total with every evaluation once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sb3_contrib")

from opsched.agents import Run, TrainConfig, resume, train  # noqa: E402

SETTINGS = {
    "max_nodes": "32", "train_graphs": "layered:20:1,erdos_renyi:24:2", "train_machines": "cpu:8:90:40,random:5",
    "validation_graphs": "watts_strogatz:20:3", "validation_machines": "cpu:16:80:100",
    "eval_freq": "128", "checkpoint_freq": "128", "imitation_rounds": "2", "iteration_rounds": "1",
}
STEPS = 256


def _config(tmp_path: Path, name: str) -> TrainConfig:
    return TrainConfig(name=name, hyperparams="tiny", n_envs=1, timesteps=STEPS, out=str(tmp_path),
                       overrides=dict(SETTINGS))


class StopAt:
    """``stop_when``: True at the ``n``-th check of ``phase`` (and never again)."""

    def __init__(self, phase: str, n: int) -> None:
        self.phase, self.n, self.seen = phase, n, 0

    def __call__(self, phase: str) -> bool:
        if phase == self.phase:
            self.seen += 1
            return self.seen == self.n
        return False


class Record:
    """``stop_when`` that never stops and records the phase of every check."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, phase: str) -> bool:
        self.calls.append(phase)
        return False

    def nth(self, phase: str, block: int, where: float = 0.5) -> int:
        """The count of ``phase`` checks at ``where`` (0..1) into its ``block``-th
        run of consecutive checks (0: the first), as :class:`StopAt` counts them."""
        blocks, count, last = [], 0, None
        for p in self.calls:
            if p == phase:
                count += 1
                if last != phase:
                    blocks.append([count, count])
                blocks[-1][1] = count
            last = p
        lo, hi = blocks[block]
        return max(lo, min(hi, lo + int(where * (hi - lo))))


def _warm_rows(run: Run) -> list[dict[str, float]]:
    drop = ("wall_s", "train_return")
    return [{k: v for k, v in r.items() if k not in drop} for r in run.evaluations() if r["imitation_round"] >= 0]


def _weights(path: Path) -> dict[str, np.ndarray]:
    import zipfile

    import torch as th

    with zipfile.ZipFile(path) as zf, zf.open("policy.pth") as fh:
        state = th.load(fh, weights_only=True)
    return {k: v.numpy() for k, v in state.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Run, Record]:
    """The run uninterrupted, and where it checked for a stop."""
    record = Record()
    run = train(_config(tmp_path_factory.mktemp("ref"), "ref"), progress=False, stop_when=record)
    assert not run.interrupted
    return run, record


# evaluation blocks: imitation rounds 0 and 1, the expert-iteration round, steps 0, 128, 256
@pytest.mark.parametrize("phase,block,where", [
    ("imitation", 0, 0.0),     # before round 0 has played an episode
    ("imitation", 1, 0.5),     # inside round 1 (round 0 finished and saved)
    ("iteration", 0, 0.5),     # inside the expert-iteration round, imitation done
    ("evaluation", 0, 0.5),    # inside round 0's validation evaluation
    ("evaluation", 3, 0.5),    # inside the step-0 evaluation that opens the RL phase
])
def test_a_run_stopped_in_the_warm_start_resumes_it_exactly(tmp_path, reference, phase, block, where):
    reference, record = reference
    n = record.nth(phase, block, where)
    stop = StopAt(phase, n)
    run = train(_config(tmp_path, "cut"), progress=False, stop_when=stop)
    assert stop.seen >= n and run.interrupted
    assert not (run.path / "policy").exists()                  # nothing exported from an unfinished run
    assert json.loads((run.path / "summary.json").read_text())["interrupted"] is True

    done = resume(run.path, progress=False)
    assert not done.interrupted and (done.path / "policy" / "policy.json").is_file()
    ref = Run.open(reference.path)
    # the warm start is the uninterrupted one: same rounds, same evaluations, same weights
    assert _warm_rows(Run.open(run.path)) == _warm_rows(ref)
    for name in ("round_0.zip", "round_1.zip", "round_2.zip", "final.zip"):  # round 2: expert iteration
        mine, theirs = _weights(run.path / "warm_start" / name), _weights(ref.path / "warm_start" / name)
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine), name
    summary = json.loads((run.path / "summary.json").read_text())
    expected = json.loads((ref.path / "summary.json").read_text())
    assert len(summary["imitation"]["rounds"]) == len(expected["imitation"]["rounds"]) == 2
    assert len(summary["imitation"]["iteration"]) == 1
    assert summary["num_timesteps"] == STEPS and not summary["interrupted"]
    steps = [r["timesteps"] for r in Run.open(run.path).evaluations() if r["imitation_round"] < 0]
    assert steps == [0.0, 128.0, 256.0]


@pytest.mark.parametrize("phase,block,where", [
    ("rl", 0, 0.5),            # inside the first PPO rollout
    ("rl", 1, 0.5),            # inside the second rollout (the step-128 checkpoint is there)
    ("evaluation", 4, 0.5),    # inside the step-128 evaluation
    ("evaluation", 5, 0.5),    # inside the last evaluation, after the last update
])
def test_a_run_stopped_in_the_rl_phase_continues_it(tmp_path, reference, phase, block, where):
    reference, record = reference
    stop = StopAt(phase, record.nth(phase, block, where))
    run = train(_config(tmp_path, "cut"), progress=False, stop_when=stop)
    assert run.interrupted and not (run.path / "policy").exists()
    cut = Run.open(run.path).last_checkpoint().steps
    assert cut <= STEPS

    done = resume(run.path, progress=False)
    assert not done.interrupted and (done.path / "policy" / "policy.json").is_file()
    r = Run.open(run.path)
    assert r.last_checkpoint().steps == STEPS
    steps = [row["timesteps"] for row in r.evaluations() if row["imitation_round"] < 0]
    assert steps == [0.0, 128.0, 256.0]                         # each evaluation once, none lost
    assert _warm_rows(r) == _warm_rows(Run.open(reference.path))  # the warm start was not run again
    summary = json.loads((run.path / "summary.json").read_text())
    assert len(summary["imitation"]["rounds"]) == 2 and summary["num_timesteps"] == STEPS


def test_ctrl_c_in_the_warm_start_then_resume_finishes_it(tmp_path):
    """The defect as a user met it: SIGINT to `opsched train-policy` during the
    imitation rounds, then `--resume`: every round is there, the RL phase ran."""
    code = ("import sys, opsched.commands.train; from opsched.cli import main; "
            "sys.argv = ['opsched'] + sys.argv[1:]; main()")
    sets = [x for k, v in {**SETTINGS, "imitation_rounds": "6", "iteration_rounds": "0"}.items()
            for x in ("--set", f"{k}={v}")]
    args = [sys.executable, "-c", code, "train-policy", "--out", str(tmp_path), "--name", "int", "--hyperparams",
            "tiny", "--n-envs", "1", "--timesteps", "128", "--no-progress", *sets]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    run = tmp_path / "int_1"
    try:
        deadline = time.time() + 120
        while not (run / "warm_start" / "imitation" / "state.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the warm start never finished a round"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "--resume" in out
    assert not (run / "policy").exists() and not list((run / "checkpoints").glob("*.zip"))
    cut = json.loads((run / "warm_start" / "imitation" / "state.json").read_text())["next_round"]
    assert cut < 6

    again = subprocess.run([sys.executable, "-c", code, "train-policy", "--resume", str(run), "--no-progress"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert [r["round"] for r in summary["imitation"]["rounds"]] == list(range(6))
    assert summary["num_timesteps"] == 128 and (run / "policy" / "policy.json").is_file()
    rows = Run.open(run).evaluations()
    assert [r["imitation_round"] for r in rows if r["imitation_round"] >= 0] == list(range(6))
    assert [r["timesteps"] for r in rows if r["imitation_round"] < 0] == [0.0, 128.0]
