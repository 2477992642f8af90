"""``opsched tune``: Optuna over the agent's hyperparameters, ask/tell.

Each trial is one ``train()`` run (its own run folder under ``<out>/``) with
sampled learning rate, entropy coefficient, ``n_steps`` and encoder depth and
width (a key fixed with ``--set`` is not searched).  The objective is the lowest held-out geometric-mean makespan ratio
against ``critical-path-first`` the trial reached (lower is better); every
periodic evaluation is reported to the pruner, which can stop a trial early.

Workers: any number of ``opsched tune`` processes, on any machines, that
point at the same study storage share the study.  ``--n-trials`` is a cap on
the study as a whole: a worker starts a trial only while fewer than
``n_trials`` trials exist, and since Optuna numbers a study's trials 0, 1, 2
... atomically, a trial whose number is at or above the cap (two workers
asked at the same moment) is closed at once as FAIL with the user attribute
``over_cap`` and never trained.  A trial therefore never runs twice, and a
worker never leaves one RUNNING (errors and Ctrl-C close it as FAIL).

Storage: default an SQLite file ``<out>/optuna.db``; ``--storage`` takes any
Optuna RDB URL (``sqlite:///path``, ``postgresql://...``, ``mysql://...``) or a
journal file (a path ending in ``.log`` / ``.journal``, or ``journal:PATH``),
which works on a shared file system without a database server.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.agents.config import ConfigError, TrainConfig

#: The search space: name -> how to sample it (Optuna distributions).
SEARCH_SPACE: dict[str, Callable[[Any], Any]] = {
    "learning_rate": lambda t: t.suggest_float("learning_rate", 1e-5, 1e-3, log=True),
    "ent_coef": lambda t: t.suggest_float("ent_coef", 1e-4, 5e-2, log=True),
    "n_steps": lambda t: t.suggest_categorical("n_steps", [128, 256, 512, 1024]),
    "rounds": lambda t: t.suggest_int("rounds", 1, 4),
    "hidden": lambda t: t.suggest_categorical("hidden", [32, 64, 96]),
}
OBJECTIVE_KEY = "gmean_cpf"


@dataclass
class TuneConfig:
    study: str = "opsched-ppo"
    storage: str | None = None
    n_trials: int = 20
    #: The training config every trial starts from (trials override the searched keys).
    base: TrainConfig = field(default_factory=lambda: TrainConfig(timesteps=20_000))
    progress: bool = False


def storage_url(storage: str | None, out: str | Path) -> str:
    """The Optuna storage URL (or journal path) a ``--storage`` value means."""
    if storage is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{Path(out).resolve() / 'optuna.db'}"
    return storage


def make_storage(storage: str | None, out: str | Path) -> Any:
    """An Optuna storage object: journal file, RDB (SQLite waits for locks instead of failing)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    url = storage_url(storage, out)
    if url.startswith("journal:") or url.endswith((".log", ".journal")):
        path = url[len("journal:"):] if url.startswith("journal:") else url
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(path))
    if "://" not in url:
        raise ConfigError(f"--storage {storage!r}: not a database URL (sqlite:///..., postgresql://...) "
                          "nor a journal file (*.log, *.journal, journal:PATH)")
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": 60}}
    # Workers started together race to create the schema of a new database; the
    # loser sees "table ... already exists" or a UNIQUE violation on the schema
    # version row.  By then the schema is there, so connecting again succeeds.
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError) as exc:
            race = "already exists" in str(exc) or "alembic_version" in str(exc)
            if not race or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(cfg: TuneConfig) -> Any:
    import optuna

    return optuna.create_study(
        study_name=cfg.study, storage=make_storage(cfg.storage, cfg.base.out), direction="minimize",
        load_if_exists=True,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )


def trial_config(base: TrainConfig, params: dict[str, Any], name: str) -> TrainConfig:
    """``base`` with the trial's parameters as ``--set`` overrides."""
    overrides = dict(base.overrides)
    overrides.update(params)
    return dataclasses.replace(base, name=name, overrides=overrides, ppo={})


def _started(study: Any) -> int:
    """Trials that count against the cap: all but those closed as over the cap."""
    return sum(1 for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("over_cap"))


def run_worker(cfg: TuneConfig, log: Callable[[str], None] = print) -> list[int]:
    """Run trials until the study holds ``n_trials``; returns the numbers this worker trained."""
    import optuna
    from optuna.trial import TrialState

    from opsched.agents.train import train

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(cfg)
    mine: list[int] = []
    while _started(study) < cfg.n_trials:
        trial = study.ask()
        if trial.number >= cfg.n_trials + _over_cap_before(study, trial.number):
            trial.set_user_attr("over_cap", True)
            study.tell(trial, state=TrialState.FAIL)
            break
        params = {k: sample(trial) for k, sample in SEARCH_SPACE.items() if k not in cfg.base.overrides}
        tcfg = trial_config(cfg.base, params, f"{cfg.study}_t{trial.number}")

        def on_eval(steps: int, row: dict[str, float], trial: Any = trial) -> bool:
            trial.report(row[OBJECTIVE_KEY], step=steps)
            return trial.should_prune()

        try:
            run = train(tcfg, argv=["opsched", "tune", f"(trial {trial.number})"], progress=cfg.progress,
                        on_eval=on_eval)
        except BaseException as exc:
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("run", str(run.path))
        mine.append(trial.number)
        values = [r[OBJECTIVE_KEY] for r in run.evaluations() if math.isfinite(r[OBJECTIVE_KEY])]
        if run.interrupted:
            study.tell(trial, state=TrialState.FAIL)
            trial_note = "interrupted"
            log(f"trial {trial.number}: {trial_note}; stopping this worker")
            break
        if run.summary.get("pruned"):
            study.tell(trial, state=TrialState.PRUNED)
            log(f"trial {trial.number}: pruned at step {run.num_timesteps}")
        elif not values:
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, min(values))
            log(f"trial {trial.number}: {OBJECTIVE_KEY} {min(values):.4f}  {params}")
    return mine


def _over_cap_before(study: Any, number: int) -> int:
    """Over-cap trials numbered below ``number`` (they used numbers, not budget)."""
    return sum(1 for t in study.get_trials(deepcopy=False) if t.number < number and t.user_attrs.get("over_cap"))


def trial_params(cfg: TuneConfig, number: int) -> dict[str, Any]:
    """The parameters of finished trial ``number`` (``--trial N``)."""
    from optuna.trial import TrialState

    study = open_study(cfg)
    for t in study.get_trials(deepcopy=False):
        if t.number == number:
            if t.state != TrialState.COMPLETE:
                raise ConfigError(f"study {cfg.study!r}: trial {number} is {t.state.name}, not COMPLETE")
            return dict(t.params)
    raise ConfigError(f"study {cfg.study!r}: no trial {number} (it has {len(study.trials)} trials)")


def retrain(cfg: TuneConfig, number: int, base: TrainConfig | None = None, argv: list[str] | None = None,
            progress: bool = True) -> Any:
    """Train a full run with finished trial ``number``'s parameters (``--trial N``)."""
    from opsched.agents.train import train

    params = trial_params(cfg, number)
    base = base or cfg.base
    return train(trial_config(base, params, f"{cfg.study}_trial{number}"), argv=argv, progress=progress)


def summary(cfg: TuneConfig) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, params (for the CLI table)."""
    study = open_study(cfg)
    return [{"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
             "run": t.user_attrs.get("run"), "over_cap": bool(t.user_attrs.get("over_cap"))}
            for t in study.get_trials(deepcopy=False)]
