"""``opsched train-policy``: train the RL scheduler (MaskablePPO + graph encoder) into a run folder.

The options follow the vocabulary every command shares (``--progress/--no-progress``,
``--machine`` without a short flag, ``-m`` the model, ``-b`` the batch); the
``--hyperparams`` choices are read from ``agents/hyperparams/ppo.yml`` itself, so
``--help`` lists exactly the entries there are.  The run's ``command.txt``
records the command as typed (:func:`~opsched.commands.flags.typed_command`): a resumed run's line is
``opsched train-policy --resume runs/ppo_3 --timesteps 50000``, not a fresh
run's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from opsched.commands.app import app, progress_option, want_progress
from opsched.commands.flags import DEFAULT_RUN_MINUTES, DEFAULT_TIMESTEPS, hyperparams_help, typed_command


@app.command("train-policy", help=(
    "Train a scheduling policy into <out>/<name>_<N>/ (config, command line, TensorBoard events, "
    f"checkpoints, validation evaluations, the exported policy). The default run takes about "
    f"{DEFAULT_RUN_MINUTES} minutes on 2 cores. Ctrl-C saves a checkpoint; --resume continues it."))
def train_policy(
    ctx: typer.Context,
    name: str = typer.Option("ppo", "--name", help="Run name: the folder is <out>/<name>_<N>."),
    timesteps: Optional[int] = typer.Option(None, "--timesteps", min=0, show_default=False,
                                            help="PPO environment steps after the warm start (imitation, then "
                                                 f"expert iteration); default {DEFAULT_TIMESTEPS}, 0: none. "
                                                 "With --resume: the new total, by default the run's own."),
    n_envs: int = typer.Option(2, "--n-envs", min=1, help="Parallel environments (subprocesses when > 1)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the policy, the environments and the warm start."),
    hyperparams: str = typer.Option("default", "--hyperparams", help=hyperparams_help("PPO / encoder settings.")),
    set_: list[str] = typer.Option([], "--set", show_default=False,
                                   help="Override a hyperparameter or setting: key=value (repeatable; default "
                                        "none), e.g. --set learning_rate=3e-4 --set eval_freq=2000."),
    backend: str = typer.Option("sim", "--backend", help="Where episodes run: sim (the simulator) or torch-cpu "
                                "(measured on this machine; start from a simulator run with --init)."),
    init: Optional[Path] = typer.Option(None, "--init", show_default=False,
                                        help="Fine-tune from this run folder's best model (default: none; a fresh "
                                             "policy, warm-started by imitation)."),
    resume: Optional[Path] = typer.Option(None, "--resume", show_default=False,
                                          help="Continue this run folder from its last checkpoint (default: none; "
                                               "a new run)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Folder that holds the run folders."),
    config: Optional[Path] = typer.Option(None, "--config", show_default=False,
                                          help="Start from a config.yaml, e.g. a run's (default: the built-in "
                                               "settings)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", show_default=False,
                                          help="Run the env workers as Ray actors on a cluster: ray (Ray's default: "
                                               "RAY_ADDRESS or the cluster started here) or ray:ADDRESS; the "
                                               "learner stays here (default: local subprocesses). Needs "
                                               "opsched[cluster]."),
    progress: Optional[bool] = progress_option(),
) -> None:
    from opsched.agents import TrainConfig, train
    from opsched.agents import resume as resume_run
    from opsched.agents.config import ConfigError, parse_set

    console = Console(stderr=True)
    argv = typed_command(ctx)
    show = want_progress(progress)
    if resume is not None:
        if set_ or init or config or cluster:
            raise ConfigError("--resume continues a run with its own config (its cluster too); only --timesteps may "
                              "change it")
        run = resume_run(resume, timesteps=timesteps, argv=argv, progress=show, console=console)
    else:
        cfg = TrainConfig.load(config) if config else TrainConfig()
        cfg.name, cfg.n_envs, cfg.seed, cfg.hyperparams, cfg.backend, cfg.out = (
            name, n_envs, seed, hyperparams, backend, str(out))
        if config:
            cfg.ppo = {}  # re-resolve from --hyperparams and --set
        if timesteps is not None:
            cfg.timesteps = timesteps
        if cluster is not None:
            from opsched.agents.cluster import parse_cluster, require_ray

            cfg.cluster = str(parse_cluster(cluster))
            require_ray()  # before a run folder is made
        cfg.init = str(init) if init else None
        cfg.overrides = {**cfg.overrides, **parse_set(set_)}
        run = train(cfg, argv=argv, progress=show, console=console)
    print_result(run, console)
    if run.interrupted:
        raise SystemExit(130)  # the shell's code for "stopped by Ctrl-C" (typer.Exit is lost under cli.main)


def print_result(run, console: Console) -> None:
    """The run folder and its latest validation figures against each baseline."""
    latest = run.summary.get("latest") or {}
    table = Table(title=f"{run.path}  (step {run.num_timesteps}"
                        f"{', interrupted' if run.interrupted else ''})")
    for col in ("validation ratio vs", "geo-mean", "mean", "worst"):
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
