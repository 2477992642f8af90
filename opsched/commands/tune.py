"""``opsched tune``: Optuna search over the agent's hyperparameters (one worker per process).

Flags as every command spells them (``--progress/--no-progress``, the
``--hyperparams`` entries of ``agents/hyperparams/ppo.yml`` listed by
``--help``); ``--trial N`` retrains into a run folder whose ``command.txt``
holds the command as typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from opsched.commands.app import app, progress_option, want_progress
from opsched.commands.flags import hyperparams_help, typed_command


@app.command("tune")
def tune_cmd(
    ctx: typer.Context,
    study: str = typer.Option("opsched-ppo", "--study", help="Study name (shared by every worker)."),
    storage: Optional[str] = typer.Option(None, "--storage", show_default=False,
                                          help="Optuna storage: a database URL (sqlite:///..., postgresql://..., "
                                               "mysql://...) or a journal file (*.log, *.journal, journal:PATH) "
                                               "(default: the SQLite file <out>/optuna.db)."),
    n_trials: int = typer.Option(20, "--n-trials", min=1, help="Cap on the study's trials, across all workers."),
    trial: Optional[int] = typer.Option(None, "--trial", min=0, show_default=False,
                                        help="Retrain with finished trial N's parameters (a full run with "
                                             "--timesteps) instead of searching (default: search)."),
    timesteps: Optional[int] = typer.Option(None, "--timesteps", min=0, show_default=False,
                                            help="PPO steps per trial (default 20000; with --trial: of the "
                                                 "retraining run, default 0)."),
    n_envs: int = typer.Option(2, "--n-envs", min=1, help="Parallel environments per trial."),
    seed: int = typer.Option(0, "--seed", help="Seed of every trial's training."),
    hyperparams: str = typer.Option("default", "--hyperparams",
                                    help=hyperparams_help("The entry the trials start from.")),
    set_: list[str] = typer.Option([], "--set", show_default=False,
                                   help="Fixed overrides for every trial: key=value (repeatable; default none)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Folder of the trial run folders (and the default "
                             "study file)."),
    show: bool = typer.Option(False, "--show", help="Only list the study's trials."),
    heartbeat: int = typer.Option(60, "--heartbeat", min=0, help="Seconds between a running trial's heartbeats "
                                  "(database storages): a trial whose worker died is marked failed after two "
                                  "missed beats and retried by another worker (0: off)."),
    progress: Optional[bool] = progress_option(),
) -> None:
    """Search PPO / encoder hyperparameters with Optuna (ask/tell, pruning, shared storage)."""
    from opsched.agents.config import TrainConfig, parse_set
    from opsched.agents.tune import TuneConfig, retrain, run_worker, summary

    console = Console(stderr=True)
    base = TrainConfig(n_envs=n_envs, seed=seed, hyperparams=hyperparams, out=str(out),
                       overrides=parse_set(set_), timesteps=20_000)
    cfg = TuneConfig(study=study, storage=storage, n_trials=n_trials, base=base,
                     progress=want_progress(progress), heartbeat=heartbeat)
    if show:
        print_trials(summary(cfg), console)
        return
    if trial is not None:
        full = TrainConfig(n_envs=n_envs, seed=seed, hyperparams=hyperparams, out=str(out),
                           overrides=parse_set(set_))
        if timesteps is not None:
            full.timesteps = timesteps
        run = retrain(cfg, trial, base=full, argv=typed_command(ctx), progress=want_progress(progress))
        from opsched.commands.train import print_result

        print_result(run, console)
        return
    if timesteps is not None:
        base.timesteps = timesteps
    done = run_worker(cfg, log=console.print)
    console.print(f"this worker trained trial(s) {done or 'none'}")
    print_trials(summary(cfg), console)


def print_trials(rows: list[dict], console: Console) -> None:
    table = Table(title="trials (value = validation geo-mean makespan ratio vs critical-path-first)")
    for col in ("#", "state", "value", "params", "run"):
        table.add_column(col)
    for r in rows:
        if r["over_cap"]:
            continue
        value = "" if r["value"] is None else f"{r['value']:.4f}"
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        table.add_row(str(r["number"]), r["state"], value, params, r["run"] or "")
    console.print(table)
