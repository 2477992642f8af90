"""The planning engine: everything that decides a schedule, without gymnasium or torch.

* :mod:`~opsched.engine.contracts` -- the typed plug-ins: performance model,
  runtime model, backend; and the time table;
* :mod:`~opsched.engine.sim` -- the discrete-event simulator state and plan replay;
* :mod:`~opsched.engine.layout` -- the observation keys and the flat action layout;
* :mod:`~opsched.engine.observe` -- per-episode static data and the observation builder;
* :mod:`~opsched.engine.coarsen` -- grouping graphs larger than the observation;
* :mod:`~opsched.engine.episode` -- the one decision loop that the Gymnasium
  environment (``opsched.envs``), the exported scheduler (``opsched.policies``)
  and imitation (``opsched.agents``) all drive.

Submodules are imported on first use (``opsched.engine.models.analytic`` imports
the contracts, and the simulator imports the analytic model).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TimeTable": "contracts", "PerfModel": "contracts", "RuntimeModel": "contracts", "Backend": "contracts",
    "SimStatic": "sim", "SimState": "sim", "prepare": "sim", "replay": "sim", "lower_bound": "sim",
    "sequential_makespan": "sim", "cached_fingerprint": "sim", "default_perf_model": "sim",
    "ActionLayout": "layout", "OBS_KEYS": "layout", "LEVEL_KEY": "layout", "MAX_DEVICES": "layout",
    "MAX_LEVELS": "layout",
    "EpisodeData": "observe", "Observer": "observe", "prepare_episode": "observe",
    "Coarsening": "coarsen", "coarsen": "coarsen",
    "Episode": "episode", "run_episode": "episode",
}


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'opsched.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"opsched.engine.{mod}"), name)


__all__ = sorted(_EXPORTS)
