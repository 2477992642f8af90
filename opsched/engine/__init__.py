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
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # the names above, for type checkers (imported on first use at run time)
    from opsched.engine.coarsen import Coarsening, coarsen
    from opsched.engine.contracts import Backend, PerfModel, RuntimeModel, TimeTable
    from opsched.engine.episode import Episode, run_episode
    from opsched.engine.layout import LEVEL_KEY, MAX_DEVICES, MAX_LEVELS, OBS_KEYS, ActionLayout
    from opsched.engine.observe import EpisodeData, Observer, prepare_episode
    from opsched.engine.sim import (
        SimState,
        SimStatic,
        cached_fingerprint,
        default_perf_model,
        lower_bound,
        prepare,
        replay,
        sequential_makespan,
    )


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'opsched.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"opsched.engine.{mod}"), name)


#: Literal, so type checkers read it: the sorted names of ``_EXPORTS`` (tests/test_lazy_exports.py).
__all__ = [
    "ActionLayout", "Backend", "Coarsening", "Episode", "EpisodeData", "LEVEL_KEY", "MAX_DEVICES",
    "MAX_LEVELS", "OBS_KEYS", "Observer", "PerfModel", "RuntimeModel", "SimState", "SimStatic", "TimeTable",
    "cached_fingerprint", "coarsen", "default_perf_model", "lower_bound", "prepare", "prepare_episode",
    "replay", "run_episode", "sequential_makespan",
]
