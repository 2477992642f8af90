"""``opsched tune``: Optuna over the agent's hyperparameters, ask/tell.

Each trial is one ``train()`` run (its own run folder under ``<out>/``) with
sampled learning rate, entropy coefficient, ``n_steps`` and encoder depth and
width (a key fixed with ``--set`` is not searched).  The objective is the lowest validation geometric-mean makespan ratio
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
``postgresql://`` uses psycopg 3 (the ``[cluster]`` extra) when psycopg2 is
not installed.

A killed worker (``kill -9``, a lost machine): on an RDB storage every worker
beats Optuna's heartbeat for its running trial (``heartbeat`` seconds;
``RDBStorage(heartbeat_interval=..., grace_period=2 x that,
heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(...))``, the
new name of ``failed_trial_callback=RetryFailedTrialCallback``).  A trial
whose heartbeat stopped is marked FAIL by the next worker that looks
(``fail_stale_trials``, before each ask and while a worker waits) and queued
again with the same parameters (system attributes ``failed_trial``,
``retry_history``); the retry takes the failed trial's place under the cap.
A worker that finds the cap reached stays while other trials still run, so
a retry of one of them is never left without a worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
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
    #: Seconds between a running trial's heartbeats (RDB storages; 0: no heartbeat).
    heartbeat: int = 60
    #: Retries of a trial whose worker died (each retry is a new trial with its parameters).
    max_retry: int = 2


def storage_url(storage: str | None, out: str | Path) -> str:
    """The Optuna storage URL (or journal path) a ``--storage`` value means."""
    if storage is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{Path(out).resolve() / 'optuna.db'}"
    return storage


def make_storage(storage: str | None, out: str | Path, heartbeat: int = 0, max_retry: int = 2) -> Any:
    """An Optuna storage object: journal file, RDB (SQLite waits for locks instead of failing);
    ``heartbeat`` > 0: RDB trials beat a heartbeat and a stale one is failed and retried."""
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
    url = _postgres_driver(url)
    beat: dict[str, Any] = {}
    if heartbeat > 0:
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        beat = dict(heartbeat_interval=int(heartbeat), grace_period=2 * int(heartbeat),
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry))
    # Workers started together race to create the schema of a new database.  On
    # PostgreSQL the creation is serialized with a session advisory lock (its DDL is
    # transactional, so a loser cannot even see the winner's half-made schema to
    # decide it lost).  Elsewhere the loser's create fails (a duplicate table or a
    # UNIQUE violation on the schema version row); then the schema appears - which
    # is what is checked, not the error's wording - and connecting again succeeds.
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            with _schema_lock(url, kwargs):
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == 4 or not _wait_for_schema(url, kwargs, timeout_s=10.0):
                raise  # not the creation race: the schema is not there, so retrying cannot help
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


_SCHEMA_LOCK_KEY = 0x6F707363  # "opsc": the advisory lock every opsched worker takes to create a schema


@contextlib.contextmanager
def _schema_lock(url: str, engine_kwargs: dict[str, Any]) -> Iterator[None]:
    """PostgreSQL: hold ``pg_advisory_lock`` while Optuna creates (or finds) its schema, so
    workers started together create it one after the other.  Other databases: no lock."""
    if not url.startswith("postgresql"):
        yield
        return
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _SCHEMA_LOCK_KEY})
    finally:
        engine.dispose()


def _wait_for_schema(url: str, engine_kwargs: dict[str, Any], timeout_s: float) -> bool:
    """Whether Optuna's schema appears at ``url`` within ``timeout_s`` (another worker's
    creation may still be committing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if _schema_exists(url, engine_kwargs):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def _postgres_driver(url: str) -> str:
    """``postgresql://`` means SQLAlchemy's psycopg2 driver; use psycopg 3 when only it is installed."""
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def _schema_exists(url: str, engine_kwargs: dict[str, Any]) -> bool:
    """Whether the database at ``url`` already holds Optuna's schema (its version table)."""
    import sqlalchemy
    import sqlalchemy.exc

    try:
        engine = sqlalchemy.create_engine(url, **engine_kwargs)
        try:
            return "alembic_version" in sqlalchemy.inspect(engine).get_table_names()
        finally:
            engine.dispose()
    except sqlalchemy.exc.SQLAlchemyError:
        return False


def open_study(cfg: TuneConfig) -> Any:
    import optuna

    return optuna.create_study(
        study_name=cfg.study, storage=make_storage(cfg.storage, cfg.base.out, cfg.heartbeat, cfg.max_retry),
        direction="minimize",
        load_if_exists=True,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )


def trial_config(base: TrainConfig, params: dict[str, Any], name: str) -> TrainConfig:
    """``base`` with the trial's parameters as ``--set`` overrides."""
    overrides = dict(base.overrides)
    overrides.update(params)
    return dataclasses.replace(base, name=name, overrides=overrides, ppo={})


def _retried(trials: list[Any]) -> set[int]:
    """Numbers of failed trials that were queued again (a retry holds their place under the cap)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def _started(study: Any) -> int:
    """Trials that count against the cap: all but those closed as over the cap and those retried."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return sum(1 for t in trials if not t.user_attrs.get("over_cap") and t.number not in retried)


def _heartbeat(study: Any) -> bool:
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(study._storage)


def _fail_stale(study: Any) -> None:
    """Optuna's ``fail_stale_trials`` (experimental since 2.9; what ``study.optimize`` calls per trial)."""
    import warnings

    import optuna

    if _heartbeat(study):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)


def _others_running(study: Any) -> bool:
    """Trials still RUNNING or queued (WAITING) that count against the cap."""
    from optuna.trial import TrialState

    return any(t.state in (TrialState.RUNNING, TrialState.WAITING) and not t.user_attrs.get("over_cap")
               for t in study.get_trials(deepcopy=False))


def _wait_for_others(study: Any, log: Callable[[str], None]) -> bool:
    """With a heartbeat: stay while other trials run, failing stale ones; True when a retry is queued."""
    from optuna.trial import TrialState

    if not _heartbeat(study):
        return False
    said = False
    while _others_running(study):
        _fail_stale(study)
        if any(t.state == TrialState.WAITING for t in study.get_trials(deepcopy=False)):
            return True
        if not said:
            log("the cap is reached; waiting while other workers' trials run (a stale one is retried here)")
            said = True
        time.sleep(min(1.0, study._storage.get_heartbeat_interval()))
    return False


def run_worker(cfg: TuneConfig, log: Callable[[str], None] = print) -> list[int]:
    """Run trials until the study holds ``n_trials``; returns the numbers this worker trained."""
    import optuna
    from optuna.trial import TrialState

    from opsched.agents.train import train

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(cfg)
    mine: list[int] = []
    while True:
        _fail_stale(study)  # a dead worker's trial: FAIL, queued again
        if _started(study) >= cfg.n_trials and not _wait_for_others(study, log):
            break
        trial = study.ask()
        if trial.number >= cfg.n_trials + _over_cap_before(study, trial.number):
            trial.set_user_attr("over_cap", True)
            study.tell(trial, state=TrialState.FAIL)
            if _wait_for_others(study, log):
                continue
            break
        trial.set_user_attr("worker", f"{platform.node()}:{os.getpid()}")
        retry = study._storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        if retry is not None:
            log(f"trial {trial.number}: retrying trial {retry}, whose worker died")
        params = {k: sample(trial) for k, sample in SEARCH_SPACE.items() if k not in cfg.base.overrides}
        tcfg = trial_config(cfg.base, params, f"{cfg.study}_t{trial.number}")

        def on_eval(steps: int, row: dict[str, float], trial: Any = trial) -> bool:
            trial.report(row[OBJECTIVE_KEY], step=steps)
            return trial.should_prune()

        from optuna.storages._heartbeat import get_heartbeat_thread  # what study.optimize beats with

        try:
            with get_heartbeat_thread(trial._trial_id, study._storage):
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
    """Over-cap and retried trials numbered below ``number`` (they used numbers, not budget)."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return sum(1 for t in trials if t.number < number and (t.user_attrs.get("over_cap") or t.number in retried))


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
