"""The Gymnasium environment (``opsched.envs.ScheduleEnv``) and its registration.

The environment ids are registered here and only here:

* ``opsched/Schedule-v0``: decisions and rewards in the discrete-event simulator;
* ``opsched/ScheduleReal-v0``: the same decisions, with the episode's Plan
  executed on the real PyTorch CPU backend at the end (``nondeterministic``:
  the reward is a measured time); its default graph is
  :data:`REAL_DEFAULT_GRAPHS` (random DAGs have no PyTorch code to run).

Importing this package never fails for want of gymnasium (the core of opsched
does not need it): registration is skipped, and ``ScheduleEnv`` is imported
lazily on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opsched.engine.layout import ActionLayout  # noqa: F401  (re-exported layout helper)

if TYPE_CHECKING:  # lazily imported at run time (module __getattr__ below)
    from opsched.envs.schedule_env import InvalidActionError, MaskedDiscrete, ScheduleEnv

ENV_ID = "opsched/Schedule-v0"
REAL_ENV_ID = "opsched/ScheduleReal-v0"
_ENTRY_POINT = "opsched.envs.schedule_env:ScheduleEnv"
#: The graphs a bare ``gym.make(REAL_ENV_ID)`` executes: a small zoo Transformer
#: encoder (98 ops, a few ms per run), so the default is quick and executable.
REAL_DEFAULT_GRAPHS = ("zoo:transformer@1x0.25",)


def _register() -> bool:
    try:
        from gymnasium.envs.registration import register, registry
    except ImportError:
        return False
    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point=_ENTRY_POINT)
    if REAL_ENV_ID not in registry:
        register(id=REAL_ENV_ID, entry_point=_ENTRY_POINT,
                 kwargs={"backend": "torch-cpu", "graphs": list(REAL_DEFAULT_GRAPHS)}, nondeterministic=True)
    return True


REGISTERED = _register()


def __getattr__(name: str) -> Any:
    if name in ("ScheduleEnv", "InvalidActionError", "MaskedDiscrete"):
        from opsched.envs import schedule_env

        return getattr(schedule_env, name)
    raise AttributeError(f"module 'opsched.envs' has no attribute {name!r}")


__all__ = ["ENV_ID", "REAL_ENV_ID", "REGISTERED", "ActionLayout", "ScheduleEnv", "InvalidActionError",
           "MaskedDiscrete"]
