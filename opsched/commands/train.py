"""``opsched train-policy``: train the RL scheduler (MaskablePPO + graph encoder) into a run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from opsched.cli import app


@app.command("train-policy")
def train_policy(
    name: str = typer.Option("ppo", "--name", help="Run name: the folder is <out>/<name>_<N>."),
    timesteps: Optional[int] = typer.Option(None, "--timesteps", help="PPO environment steps (default 40000; "
                                            "with --resume: the new total)."),
    n_envs: int = typer.Option(2, "--n-envs", help="Parallel environments (subprocesses when > 1)."),
    seed: int = typer.Option(0, "--seed"),
    hyperparams: str = typer.Option("default", "--hyperparams", help="Entry of agents/hyperparams/ppo.yml."),
    set_: list[str] = typer.Option([], "--set", help="Override a hyperparameter or setting: key=value "
                                   "(repeatable), e.g. --set learning_rate=3e-4 --set eval_freq=2000."),
    backend: str = typer.Option("sim", "--backend", help="sim (simulator) or torch-cpu (measured on this "
                                "machine; start from a simulator run with --init)."),
    init: Optional[Path] = typer.Option(None, "--init", help="Fine-tune from this run's best model."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run from its last checkpoint."),
    out: Path = typer.Option(Path("runs"), "--out", help="Folder that holds the run folders."),
    config: Optional[Path] = typer.Option(None, "--config", help="Start from a config.yaml (e.g. a run's)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Train a scheduling policy; Ctrl-C saves a checkpoint, --resume continues it."""
    from opsched.agents import TrainConfig, train
    from opsched.agents import resume as resume_run
    from opsched.agents.config import ConfigError, parse_set

    console = Console(stderr=True)
    argv = command_line(name=name, timesteps=timesteps, n_envs=n_envs, seed=seed, hyperparams=hyperparams,
                        set_=set_, backend=backend, init=init, resume=resume, out=out, config=config)
    if resume is not None:
        if set_ or init or config:
            raise ConfigError("--resume continues a run with its own config; only --timesteps may change it")
        run = resume_run(resume, timesteps=timesteps, argv=argv, progress=not no_progress, console=console)
    else:
        cfg = TrainConfig.load(config) if config else TrainConfig()
        cfg.name, cfg.n_envs, cfg.seed, cfg.hyperparams, cfg.backend, cfg.out = (
            name, n_envs, seed, hyperparams, backend, str(out))
        if config:
            cfg.ppo = {}  # re-resolve from --hyperparams and --set
        if timesteps is not None:
            cfg.timesteps = timesteps
        cfg.init = str(init) if init else None
        cfg.overrides = {**cfg.overrides, **parse_set(set_)}
        run = train(cfg, argv=argv, progress=not no_progress, console=console)
    print_result(run, console)
    if run.interrupted:
        raise SystemExit(130)  # the shell's code for "stopped by Ctrl-C" (typer.Exit is lost under cli.main)


def command_line(**opts) -> list[str]:
    """The command line that reproduces this invocation (every option spelled out)."""
    argv = ["opsched", "train-policy"]
    for key, value in opts.items():
        flag = "--" + key.rstrip("_").replace("_", "-")
        if key == "set_":
            for item in value:
                argv += ["--set", item]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def print_result(run, console: Console) -> None:
    """The run folder and its latest held-out figures against each baseline."""
    latest = run.summary.get("latest") or {}
    table = Table(title=f"{run.path}  (step {run.num_timesteps}"
                        f"{', interrupted' if run.interrupted else ''})")
    for col in ("held-out ratio vs", "geo-mean", "mean", "worst"):
        table.add_column(col)
    for key in sorted(k[len("gmean_"):] for k in latest if k.startswith("gmean_")):
        table.add_row(key.replace("_", "-"), f"{latest[f'gmean_{key}']:.3f}", f"{latest[f'mean_{key}']:.3f}",
                      f"{latest[f'worst_{key}']:.3f}")
    console.print(table)
    if run.best_score is not None:
        console.print(f"best model: {run.best_model} (geo-mean ratio vs the best baseline {run.best_score:.3f})")
    if (run.path / "policy" / "policy.json").is_file():
        console.print(f"exported scheduler: {run.path / 'policy'}  (use it: opsched apply --policy {run.path / 'policy'} "
                      "--model zoo:nasnet)")
