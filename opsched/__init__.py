"""opsched: learn how to run a neural network's operation graph fast.

The core types live here; the subpackages hold the rest:
``opsched.backends`` (profiler, performance model, simulator, real executors),
``opsched.envs`` (the Gymnasium environment), ``opsched.agents`` (RL training)
and ``opsched.policies`` (heuristic baselines and the exported learned policy).
"""

from typing import TYPE_CHECKING

import opsched.envs  # noqa: E402,F401  (registers the Gymnasium ids; skipped without gymnasium)
from opsched.errors import (
    ExecutionError,
    GraphError,
    MachineError,
    ModelImportError,
    OpschedError,
    PlanError,
    PolicyError,
)
from opsched.graph import OP_KINDS, Edge, Op, OpGraph
from opsched.machine import PRESETS, Device, Link, Machine, get_machine
from opsched.plan import Assignment, Plan
from opsched.trace import Trace, TraceEvent

if TYPE_CHECKING:  # imported on first use at run time (``__getattr__``); named here for type checkers
    from opsched.adapters.torch import ScheduledModule
    from opsched.scheduled import apply
    from opsched.training import train_step

__version__ = "0.1.0"


#: Subpackages reachable as attributes after a plain ``import opsched``
#: (``opsched.importers.from_torch``), imported on first use.
_SUBPACKAGES = ("agents", "backends", "benchmarks", "engine", "envs", "importers", "planning", "policies",
                "specs", "synthetic", "timing", "zoo")


def __getattr__(name: str):
    """``opsched.apply``, ``opsched.ScheduledModule`` and the subpackages, imported on
    first use so that ``import opsched`` pulls in neither torch nor the runtime."""
    if name in ("apply", "ScheduledModule"):
        from opsched import scheduled

        return getattr(scheduled, name)
    if name == "train_step":
        from opsched.training import train_step

        return train_step
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"opsched.{name}")
    raise AttributeError(f"module 'opsched' has no attribute {name!r}")


__all__ = [
    "OP_KINDS", "PRESETS", "Assignment", "Device", "Edge", "ExecutionError", "GraphError", "Link",
    "Machine", "MachineError", "ModelImportError", "Op", "OpGraph", "OpschedError", "Plan", "PlanError",
    "PolicyError", "ScheduledModule", "Trace", "TraceEvent", "apply", "get_machine", "train_step",
]
