"""Run folders, the rl-baselines3-zoo way: one folder per run, enough to
reproduce it, resume it and read its results without the process that made it.

    runs/<name>_<N>/
        config.yaml          every resolved setting (TrainConfig)
        command.txt          the command line that made the run, then one per resume (as typed)
        versions.json        system and package versions
        tb/                  TensorBoard events (SB3 logger)
        checkpoints/         step_<steps>.zip (SB3 model) + step_<steps>.json (step counter, RNG states)
        warm_start/          the model after each warm-start round, the warm start's result
                             (final.zip, done.json) and its resumable state (opsched.agents.rounds)
        validation_baselines.json   the baselines' makespans on the validation pairs
        rl_pairs.json        the training pairs the RL phase plays, with their weights
        evaluations.csv      one row per validation evaluation
        best_model.zip       the model with the best validation ratio so far
        final_model.zip      the model at the end (or at Ctrl-C)
        learning_curve.png   validation ratios and training return against steps

Models are SB3 zips; opsched loads them with ``set_parameters`` (tensors,
``weights_only``) into a model built from ``config.yaml``, never by
unpickling the zip's Python objects.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from opsched.agents.config import ConfigError, TrainConfig
from opsched.io import atomic_write_text, next_run_dir

CHECKPOINT_RE = re.compile(r"^step_(\d+)\.json$")
PACKAGES = ("opsched", "numpy", "torch", "gymnasium", "stable-baselines3", "sb3-contrib", "optuna",
            "tensorboard", "typer", "rich", "pyyaml", "matplotlib")


@dataclass
class Checkpoint:
    """A complete checkpoint: the model zip and its state JSON (written last)."""

    steps: int
    model: Path
    state_file: Path

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())


@dataclass
class Run:
    """A run folder and what training left in it."""

    path: Path
    config: TrainConfig
    interrupted: bool = False
    num_timesteps: int = 0
    best_score: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- layout
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tb"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def evaluations_file(self) -> Path:
        return self.path / "evaluations.csv"

    @property
    def best_model(self) -> Path:
        return self.path / "best_model.zip"

    @property
    def final_model(self) -> Path:
        return self.path / "final_model.zip"

    @property
    def curve_file(self) -> Path:
        return self.path / "learning_curve.png"

    # --------------------------------------------------------------- creation
    @classmethod
    def create(cls, config: TrainConfig, argv: list[str] | None = None) -> Run:
        """A fresh ``<out>/<name>_<N>`` (N the next free number, race-free) with
        config, command line and versions written."""
        path = next_run_dir(config.out, config.name)
        run = cls(path=path, config=config)
        atomic_write_text(run.config_file, config.to_yaml())
        run.record_command(argv)
        atomic_write_text(path / "versions.json", json.dumps(versions(), indent=2) + "\n")
        run.checkpoint_dir.mkdir(exist_ok=True)
        return run

    @classmethod
    def open(cls, path: str | Path) -> Run:
        """An existing run folder (for ``--resume``, ``--init`` and reading results)."""
        path = Path(path)
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path}: not a run folder (no config.yaml)")
        return cls(path=path, config=TrainConfig.load(path / "config.yaml"))

    def record_command(self, argv: list[str] | None = None) -> None:
        """Append the command line as typed (the first line made the run; each
        ``--resume`` adds its own, e.g. ``opsched train-policy --resume
        runs/ppo_3 --timesteps 50000``).  ``argv``: the command line (the CLI
        passes the options the user gave, not the defaults); default
        ``sys.argv``, the program by its name rather than its path."""
        if argv is None:
            argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
        line = " ".join(_quote(str(a)) for a in argv)
        old = (self.path / "command.txt").read_text() if (self.path / "command.txt").exists() else ""
        atomic_write_text(self.path / "command.txt", old + line + "\n")

    # ------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (a zip without its JSON is a torn write: skipped)."""
        out = []
        if self.checkpoint_dir.is_dir():
            for f in self.checkpoint_dir.iterdir():
                m = CHECKPOINT_RE.match(f.name)
                zip_path = f.with_suffix(".zip")
                if m and zip_path.is_file():
                    out.append(Checkpoint(int(m.group(1)), zip_path, f))
        return sorted(out, key=lambda c: c.steps)

    def last_checkpoint(self) -> Checkpoint | None:
        cps = self.checkpoints()
        return cps[-1] if cps else None

    def checkpoint_paths(self, steps: int) -> tuple[Path, Path]:
        return self.checkpoint_dir / f"step_{steps}.zip", self.checkpoint_dir / f"step_{steps}.json"

    # ------------------------------------------------------------ evaluations
    def evaluations(self) -> list[dict[str, float]]:
        """The rows of ``evaluations.csv`` as floats."""
        if not self.evaluations_file.exists():
            return []
        with self.evaluations_file.open() as fh:
            return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(fh)]

    def keep_evaluations(self, n: int) -> None:
        """Keep the first ``n`` rows of ``evaluations.csv`` (a resumed run drops the
        rows its interrupted round or rollout wrote after the state it resumes from)."""
        if not self.evaluations_file.exists():
            return
        lines = self.evaluations_file.read_text().splitlines(keepends=True)
        if len(lines) > n + 1:
            atomic_write_text(self.evaluations_file, "".join(lines[: n + 1]) if n > 0 else "")
            if n == 0:
                self.evaluations_file.unlink()

    @property
    def warm_start_dir(self) -> Path:
        """The warm start's models (``round_<k>.zip``, ``final.zip``) and resumable state."""
        return self.path / "warm_start"

    def model_for_init(self) -> Path:
        """The model ``--init`` starts from: the best one, else the final one, else the last checkpoint."""
        for p in (self.best_model, self.final_model):
            if p.is_file():
                return p
        cp = self.last_checkpoint()
        if cp is None:
            raise ConfigError(f"{self.path}: no model to start from (no best/final model, no checkpoint)")
        return cp.model


class RunLock:
    """An exclusive lock on the run folder, so two processes never train into
    (and overwrite) the same run.  It is an OS file lock (``filelock``): the
    kernel releases it when its process dies, so a killed run never leaves a
    stale lock behind."""

    def __init__(self, run_path: Path) -> None:
        from filelock import FileLock

        self.file = Path(run_path) / ".lock"
        self._lock = FileLock(self.file)

    def __enter__(self) -> RunLock:
        from filelock import Timeout

        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise ConfigError(f"{self.file.parent}: run is in use by another opsched process") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def versions() -> dict[str, Any]:
    """System and package versions (written to ``versions.json``)."""
    pkgs = {}
    for name in PACKAGES:
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    return {
        "opsched_git": _git_commit(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "packages": pkgs,
    }


def _git_commit() -> str | None:
    """The commit (plus ``-dirty``) of the opsched checkout, when it is one."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) if sha else None


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\"'\"'") + "'"


def plot_learning_curve(run: Run) -> Path | None:
    """``learning_curve.png``: the validation geometric-mean makespan ratio against
    each baseline (and the per-pair best), with the episode returns, over the
    imitation rounds (left, when there were any) and the PPO steps (right)."""
    rows = run.evaluations()
    if not rows:
        return None
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from opsched.io import atomic_write_bytes

    imitation = [r for r in rows if r.get("imitation_round", -1) >= 0]
    ppo = [r for r in rows if r.get("imitation_round", -1) < 0]
    panels = [(imitation, "imitation_round", "imitation (DAgger) round")] if imitation else []
    panels.append((ppo, "timesteps", "PPO environment steps"))
    fig, axes = plt.subplots(2, len(panels), figsize=(5 + 4 * len(panels), 7), squeeze=False,
                             sharey="row", gridspec_kw={"width_ratios": [1] * (len(panels) - 1) + [2]})
    ratio_keys = [k for k in rows[0] if k.startswith("gmean_")]
    for col, (sel, xkey, xlabel) in enumerate(panels):
        ax, ax2 = axes[0][col], axes[1][col]
        xs = [r[xkey] for r in sel]
        for i, key in enumerate(ratio_keys):  # line styles keep coinciding baselines visible
            ax.plot(xs, [r[key] for r in sel], marker="o", ms=3, color=f"C{i}", ls=("-", "--", ":", "-.")[i % 4],
                    lw=2.2 - 0.4 * (i % 4), label=key[len("gmean_"):].replace("_", "-"))
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
        ax2.plot(xs, [r.get("train_return", float("nan")) for r in sel], marker="o", ms=3, color="C6",
                 label="training episodes (PPO rollouts)")
        ax2.plot(xs, [r.get("mean_return", float("nan")) for r in sel], marker="o", ms=3, color="C7",
                 label="validation episodes (greedy)")
        ax2.set_xlabel(xlabel)
        ax2.grid(alpha=0.3)
        if xkey == "imitation_round":
            from matplotlib.ticker import MaxNLocator

            ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("validation makespan ratio\n(learned / baseline, geo-mean; <1 = faster)")
    axes[1][0].set_ylabel("episode return\n(-makespan / sequential)")
    axes[0][-1].legend(loc="best", fontsize=8, title="vs baseline", title_fontsize=8)
    axes[1][-1].legend(loc="best", fontsize=8)
    fig.suptitle(f"{run.path.name}: learned policy on the validation set")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(run.curve_file, buf.getvalue())
    return run.curve_file
