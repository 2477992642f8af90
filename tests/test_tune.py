"""`opsched tune`: workers in separate processes share one study, respect the global cap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

#: A tiny run's settings, without its length (the PostgreSQL tests give their own ``--timesteps``).
TINY_SETTINGS = [
    "--hyperparams", "tiny", "--n-envs", "1",
    "--set", "n_steps=32", "--set", "hidden=16", "--set", "rounds=1", "--set", "imitation_rounds=0",
    "--set", "max_nodes=16",
    "--set", "train_graphs=layered:12:1", "--set", "train_machines=cpu:8:90:40",
    "--set", "validation_graphs=erdos_renyi:12:3", "--set", "validation_machines=cpu:16:80:100",
    "--set", "eval_freq=32", "--set", "checkpoint_freq=64",
]
TINY = [*TINY_SETTINGS, "--timesteps", "64"]
CODE = ("import sys, opsched.commands.tune; from opsched.cli import main; "
        "sys.argv = ['opsched'] + sys.argv[1:]; main()")


def _worker(out: Path, storage: str, n_trials: int) -> subprocess.Popen:
    args = [sys.executable, "-c", CODE, "tune", "--study", "s", "--storage", storage,
            "--n-trials", str(n_trials), "--out", str(out), *TINY]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _check_study(storage, n_trials: int, out: Path) -> list:
    study = optuna.load_study(study_name="s", storage=storage)
    trials = study.get_trials(deepcopy=False)
    counted = [t for t in trials if not t.user_attrs.get("over_cap")]
    assert len(counted) == n_trials                                   # the cap, exactly
    assert sorted(t.number for t in trials) == list(range(len(trials)))  # nothing lost or numbered twice
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in counted)
    assert all(t.state == optuna.trial.TrialState.FAIL for t in trials if t.user_attrs.get("over_cap"))
    runs = [t.user_attrs["run"] for t in counted]
    assert len(set(runs)) == n_trials and all(Path(r).is_dir() for r in runs)   # each trained once
    assert all(Path(r).parent == out for r in runs)
    done = [t for t in counted if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and all(0 < t.value < 100 for t in done)
    return counted


def test_two_workers_share_one_sqlite_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    procs = [_worker(tmp_path, storage, 3) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    counted = _check_study(storage, 3, tmp_path)
    # a second round of workers finds the cap reached and trains nothing
    again = _worker(tmp_path, storage, 3)
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0 and "trained trial(s) none" in out
    assert len(_check_study(storage, 3, tmp_path)) == len(counted)


def test_journal_storage_and_retrain_a_trial(tmp_path):
    from typer.testing import CliRunner

    import opsched.commands.tune  # noqa: F401
    from opsched.agents import Run
    from opsched.cli import app

    journal = str(tmp_path / "study.journal")
    r = CliRunner().invoke(app, ["tune", "--study", "s", "--storage", journal, "--n-trials", "2",
                                 "--out", str(tmp_path), *TINY], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    counted = _check_study(JournalStorage(JournalFileBackend(journal)), 2, tmp_path)
    best = next(t for t in counted if t.state == optuna.trial.TrialState.COMPLETE)
    r = CliRunner().invoke(app, ["tune", "--study", "s", "--storage", journal, "--trial", str(best.number),
                                 "--out", str(tmp_path), *TINY], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    run = Run.open(tmp_path / f"s_trial{best.number}_1")
    for key, value in best.params.items():
        assert run.config.ppo[key] == pytest.approx(value)
    assert run.final_model.is_file()
    # the retraining run records the command as typed (not the test runner's argv, not the defaults)
    line = (run.path / "command.txt").read_text().splitlines()[0]
    assert line.startswith(f"opsched tune --study s --storage {journal} --trial {best.number} --timesteps 64 ")
    assert "--n-trials" not in line and not line.split()[0].endswith("pytest")  # tmp paths may say pytest
    # an unknown trial is a clear error
    r = CliRunner().invoke(app, ["tune", "--study", "s", "--storage", journal, "--trial", "99",
                                 "--out", str(tmp_path)])
    assert r.exit_code != 0 and "no trial 99" in str(r.exception)
