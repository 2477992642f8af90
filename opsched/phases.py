"""The phases of a training-step graph: forward, backward, update.

A captured training step (``opsched.importers.torch_step.capture_step``) tags
every op with the part of the step it belongs to.  The tags live in
``graph.meta["phases"]`` (op id -> phase), not in an :class:`~opsched.graph.Op`
field: meta is saved with the graph and read back from JSON, but it is not part
of the fingerprint, so adding phases changes nothing for existing (inference)
graphs, their JSON files or caches keyed by fingerprints.  This module reads
them without importing torch (features, plans and Gantt charts can use it).
"""

from __future__ import annotations

from collections import Counter

from opsched.errors import GraphError
from opsched.graph import OpGraph

#: The phases in step order; an edge never goes from a later phase to an earlier one.
PHASES: tuple[str, ...] = ("forward", "backward", "update")
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


def op_phases(graph: OpGraph) -> dict[str, str]:
    """Op id -> phase; empty for a graph that is not a training step."""
    phases = graph.meta.get("phases")
    return dict(phases) if isinstance(phases, dict) else {}


def phase_counts(graph: OpGraph) -> dict[str, int]:
    """How many ops each phase has (every phase listed, in step order)."""
    c = Counter(op_phases(graph).values())
    return {p: c.get(p, 0) for p in PHASES}


def check_phases(graph: OpGraph) -> None:
    """Raise :class:`GraphError` unless every op has a known phase and every
    edge runs forward -> backward -> update (never back to an earlier phase)."""
    phases = op_phases(graph)
    for op in graph.ops:
        p = phases.get(op.id)
        if p not in PHASE_INDEX:
            raise GraphError(f"graph {graph.name!r}: op {op.id!r} has no valid phase ({p!r}; expected one of "
                             f"{', '.join(PHASES)})")
    for e in graph.edges:
        a, b = phases[e.src], phases[e.dst]
        if PHASE_INDEX[a] > PHASE_INDEX[b]:
            raise GraphError(f"graph {graph.name!r}: edge {e.src!r} ({a}) -> {e.dst!r} ({b}) goes back to an "
                             "earlier phase")
