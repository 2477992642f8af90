"""opsched: learn how to run a neural network's operation graph fast.

The core types live here; the subpackages hold the rest:
``opsched.backends`` (profiler, performance model, simulator, real executors),
``opsched.envs`` (the Gymnasium environment), ``opsched.agents`` (RL training)
and ``opsched.policies`` (heuristic baselines and the exported learned policy).
"""

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

import opsched.envs  # noqa: E402,F401  (registers the Gymnasium ids; skipped without gymnasium)

__version__ = "0.1.0"

__all__ = [
    "OP_KINDS", "PRESETS", "Assignment", "Device", "Edge", "ExecutionError", "GraphError", "Link",
    "Machine", "MachineError", "ModelImportError", "Op", "OpGraph", "OpschedError", "Plan", "PlanError",
    "PolicyError", "Trace", "TraceEvent", "get_machine",
]
