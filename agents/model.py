"""The SB3 model of a run: built from its config, loaded from its zips (tensors only).

What training (:mod:`opsched.agents.train`) and export (:mod:`opsched.agents.export`)
both need, kept apart so that neither imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sb3_contrib import MaskablePPO

from opsched.agents.config import ConfigError, TrainConfig
from opsched.agents.environments import make_env
from opsched.agents.policy import GraphPolicy
from opsched.agents.runs import Run
from opsched.cache import graphs_dir
from opsched.specs import load_graph, load_machine


def build_model(cfg: TrainConfig, env: Any, seed: int | None) -> MaskablePPO:
    """``MaskablePPO(GraphPolicy, env, ...)`` from the resolved hyperparameters."""
    return MaskablePPO(
        GraphPolicy, env, **cfg.ppo_kwargs(),
        policy_kwargs=dict(hidden=cfg.ppo["hidden"], rounds=cfg.ppo["rounds"], levels=cfg.level_times),
        seed=seed, device="cpu", verbose=0,
    )


def load_trained_model(run_or_zip: str | Path, env: Any = None) -> MaskablePPO:
    """A run's best model (or a given zip inside a run folder), rebuilt from the
    run's config and loaded with ``set_parameters`` (tensors only, no unpickling).

    ``env`` defaults to a one-pair env of the run's first validation pair, which
    only fixes the spaces."""
    path = Path(run_or_zip)
    run = Run.open(path if path.is_dir() else path.parent if (path.parent / "config.yaml").exists()
                   else path.parent.parent)
    zip_path = run.model_for_init() if path.is_dir() else path
    cfg = run.config
    if env is None:
        env = make_env([load_graph(cfg.validation_graphs[0], cache_dir=graphs_dir())],
                       [load_machine(cfg.validation_machines[0])], cfg.max_nodes)
    model = build_model(cfg, env, seed=None)
    set_weights(model, zip_path, "model")
    return model


def set_weights(model: MaskablePPO, zip_path: str | Path, what: str) -> None:
    """``model.set_parameters`` (tensors only), with a clear error when the zip's
    network does not fit this model (another encoder size or version)."""
    try:
        model.set_parameters(str(zip_path), exact_match=True, device="cpu")
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{what} {zip_path}: its network does not fit this policy (different encoder size, "
                          f"max_nodes or opsched version): {first}") from exc


__all__ = ["build_model", "load_trained_model", "set_weights"]
