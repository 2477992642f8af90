"""RL training: MaskablePPO with a graph encoder, run folders, Optuna tuning.

    from opsched.agents import TrainConfig, train
    run = train(TrainConfig(name="ppo"))
    run.path, run.best_model, run.evaluations()

``train`` writes ``runs/<name>_<N>/`` (see :mod:`opsched.agents.runs`);
``resume(path)`` continues a run from its last checkpoint; ``load_trained_model``
rebuilds a run's model without unpickling anything; the encoder's exact
computation (and its numpy reference) is in :mod:`opsched.agents.encoder`.

Importing this package loads torch and stable-baselines3 (the function
``train`` must shadow the submodule of the same name, so it is imported
eagerly); the CLI imports it only inside its training commands.
"""

from __future__ import annotations

import sys
import types

# SB3 writes TensorBoard events through torch.utils.tensorboard, whose
# ``tensorboard.compat.tf`` imports all of TensorFlow when it is installed
# (seconds per process, for nothing: scalars need only tensorboard's own
# writer).  ``tensorboard.compat.notf`` is tensorboard's documented switch to
# its TF stub; it affects tensorboard internals only, never ``import tensorflow``.
if "tensorflow" not in sys.modules:
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))

from opsched.agents.config import ConfigError, TrainConfig
from opsched.agents.runs import Run
from opsched.agents.train import load_trained_model, resume, train

__all__ = ["ConfigError", "Run", "TrainConfig", "load_trained_model", "resume", "train"]
