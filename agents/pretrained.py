"""Training and exporting the policy shipped with opsched (``policies/pretrained``).

    python -m opsched.agents.pretrained [--timesteps N] [--out DIR] [--runs DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opsched.agents.export import export_run
from opsched.errors import PolicyError

#: The shipped policy's training run: the default ``opsched train-policy``
#: configuration (training and validation sets, PPO hyperparameters, imitation
#: warm start from critical-path-first and HEFT) with seed 0.
#: ``timesteps: 0``: the shipped policy is the warm start alone (it was trained
#: before the RL phase was on by default; its figures in the README are that policy's).
PRETRAINED_SETTINGS: dict[str, Any] = {"name": "pretrained", "n_envs": 2, "seed": 0, "hyperparams": "default",
                                       "timesteps": 0}


def pretrained_dir() -> Path:
    """``policies/pretrained`` of this opsched (where ``opsched.apply`` looks by default)."""
    from opsched.policies.exported import pretrained_path

    return pretrained_path()


def make_pretrained(out: str | Path | None = None, runs: str | Path = "runs", **settings: Any) -> Path:
    """Train the shipped policy (:data:`PRETRAINED_SETTINGS`, overridable) into
    ``<runs>/pretrained_<N>`` and export its best model to ``out`` (default
    :func:`pretrained_dir`).  The documented command::

        python -m opsched.agents.pretrained          # ~2 min on 2 cores
    """
    from opsched.agents.config import TrainConfig
    from opsched.agents.train import train

    cfg = TrainConfig(**{**PRETRAINED_SETTINGS, "out": str(runs), **settings})
    run = train(cfg, argv=["python", "-m", "opsched.agents.pretrained"])
    if run.interrupted:
        raise PolicyError(f"training of the pretrained policy was interrupted; resume with --resume {run.path}")
    return export_run(run.path, out=out if out is not None else pretrained_dir())


def main(argv: list[str] | None = None) -> None:
    """Train the shipped policy's run and export it (see the module docstring)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m opsched.agents.pretrained", description=main.__doc__)
    ap.add_argument("--out", default=None, help="output folder (default: policies/pretrained)")
    ap.add_argument("--runs", default="runs", help="where the training run goes")
    ap.add_argument("--timesteps", type=int, default=None, help="training steps")
    args = ap.parse_args(argv)
    extra = {"timesteps": args.timesteps} if args.timesteps else {}
    print(f"exported to {make_pretrained(args.out, args.runs, **extra)}")


__all__ = ["PRETRAINED_SETTINGS", "make_pretrained", "pretrained_dir"]


if __name__ == "__main__":
    main()
