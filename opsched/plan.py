"""Plans: what every policy produces and every backend executes.

A :class:`Plan` gives each op of a graph a device, an intra-op thread count,
a priority and optional extra control dependencies (``after``).

Execution semantics (the simulator and the real runtimes implement exactly
this, so a Plan found anywhere replays anywhere):

* an op is *ready* when every op it reads from and every op in its ``after``
  list has finished;
* at each event (start, or any op finishing), the ready ops are considered in
  descending ``priority`` (ties: graph order) and each one whose device has
  ``threads`` free slots starts at once (greedy list scheduling);
* ``after`` encodes a deliberate wait: the environment records "hold this op
  until that one finishes" as a control dependency, which is how a learned
  policy's choice to keep cores free survives a replay.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opsched.errors import PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine

PLAN_FORMAT = "opsched.plan"
PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Assignment:
    device: str = "cpu"
    threads: int = 1
    priority: float = 0.0
    after: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Plan:
    """Per-op :class:`Assignment` for one graph on one machine."""

    assignments: Mapping[str, Assignment]
    graph_fingerprint: str = ""
    machine_fingerprint: str = ""
    policy: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (dict(self.assignments), self.graph_fingerprint, self.machine_fingerprint, self.policy) == (
            dict(other.assignments), other.graph_fingerprint, other.machine_fingerprint, other.policy)

    def __getitem__(self, op_id: str) -> Assignment:
        return self.assignments[op_id]

    def __len__(self) -> int:
        return len(self.assignments)

    @classmethod
    def build(cls, graph: OpGraph, machine: Machine, assignments: Mapping[str, Assignment],
              policy: str = "", **meta: Any) -> Plan:
        """Make a plan stamped with the graph's and machine's fingerprints, validated."""
        plan = cls(dict(assignments), graph.fingerprint(), machine.hardware_fingerprint(), policy, meta)
        plan.validate(graph, machine)
        return plan

    def validate(self, graph: OpGraph, machine: Machine, check_fingerprints: bool = True) -> None:
        """Raise :class:`PlanError` unless this plan fits ``graph`` on ``machine``."""
        where = f"plan{' ' + repr(self.policy) if self.policy else ''} for graph {graph.name!r}"
        if check_fingerprints and self.graph_fingerprint and self.graph_fingerprint != graph.fingerprint():
            raise PlanError(
                f"{where}: made for a different graph (fingerprint {self.graph_fingerprint}, "
                f"this graph is {graph.fingerprint()})"
            )
        if check_fingerprints and self.machine_fingerprint and self.machine_fingerprint != machine.hardware_fingerprint():
            raise PlanError(
                f"{where}: made for a different machine (fingerprint {self.machine_fingerprint}, "
                f"machine {machine.name!r} is {machine.hardware_fingerprint()})"
            )
        missing = [op.id for op in graph.ops if op.id not in self.assignments]
        if missing:
            raise PlanError(f"{where}: no assignment for {len(missing)} op(s), e.g. {missing[:5]}")
        extra = [k for k in self.assignments if k not in graph.index]
        if extra:
            raise PlanError(f"{where}: assignments for ops not in the graph, e.g. {extra[:5]}")
        for op_id, a in self.assignments.items():
            if a.device not in machine.device_index:
                raise PlanError(
                    f"{where}: op {op_id!r} placed on {a.device!r}, which machine {machine.name!r} lacks "
                    f"(devices: {', '.join(machine.device_index)})"
                )
            dev = machine.device(a.device)
            if not isinstance(a.threads, int) or a.threads < 1 or a.threads > dev.cores:
                raise PlanError(f"{where}: op {op_id!r} asks for {a.threads!r} threads; "
                                f"{a.device} has {dev.cores} slots")
            if dev.is_gpu and a.threads != 1:
                raise PlanError(f"{where}: op {op_id!r} on {a.device} must use threads=1 (one stream slot)")
            for dep in a.after:
                if dep not in graph.index:
                    raise PlanError(f"{where}: op {op_id!r} waits for unknown op {dep!r}")
        if any(a.after for a in self.assignments.values()):
            self._check_after_acyclic(graph, where)

    def _check_after_acyclic(self, graph: OpGraph, where: str) -> None:
        from opsched.errors import GraphError
        from opsched.graph import Edge, kahn_order

        # Kahn's algorithm over the graph's edges plus the holds: milliseconds less than building
        # the extended OpGraph, which is only built (for its message naming the cycle) when there is one
        index = graph.index
        succ = [list(x) for x in graph.succ_index]
        indeg = {i: len(p) for i, p in enumerate(graph.pred_index)}
        for op_id, a in self.assignments.items():
            i = index[op_id]
            for dep in a.after:
                if dep != op_id:
                    succ[index[dep]].append(i)
                    indeg[i] += 1
        if len(kahn_order(indeg, succ)) == len(graph.ops):
            return

        extra = [Edge(dep, op_id) for op_id, a in self.assignments.items() for dep in a.after if dep != op_id]
        try:
            OpGraph(graph.ops, graph.edges + tuple(extra), name=graph.name)
        except GraphError as exc:
            raise PlanError(f"{where}: its 'after' dependencies deadlock: {exc}") from None

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_FORMAT_VERSION,
            "policy": self.policy,
            "graph_fingerprint": self.graph_fingerprint,
            "machine_fingerprint": self.machine_fingerprint,
            "meta": dict(self.meta),
            "ops": {
                k: {"device": a.device, "threads": a.threads, "priority": a.priority, "after": list(a.after)}
                for k, a in self.assignments.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> Plan:
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{where}: not an opsched plan (missing format {PLAN_FORMAT!r})")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(f"{where}: plan format version {data.get('version')!r} is not supported")
        try:
            ops = {
                str(k): Assignment(str(v["device"]), int(v["threads"]), float(v["priority"]),
                                   tuple(str(x) for x in v.get("after", ())))
                for k, v in data["ops"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"{where}: malformed plan entry: {exc}") from None
        return cls(ops, str(data.get("graph_fingerprint", "")), str(data.get("machine_fingerprint", "")),
                   str(data.get("policy", "")), dict(data.get("meta", {})))

    def save(self, path: str | Path) -> None:
        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        from opsched.io import read_json

        return cls.from_dict(read_json(path, PlanError, "plan"), where=str(path))

    # ------------------------------------------------------------- helpers
    def dispatch_order(self, graph: OpGraph) -> list[int]:
        """Op indices by descending priority, ties in graph order."""
        return sorted(range(len(graph.ops)), key=lambda i: (-self.assignments[graph.ops[i].id].priority, i))


def uniform_plan(graph: OpGraph, machine: Machine, threads: int, device: str = "cpu",
                 priority: Mapping[str, float] | None = None, policy: str = "") -> Plan:
    """Every op on one device with the same thread count; priority defaults to
    reverse topological position (so the plan runs in topological order)."""
    n = len(graph.ops)
    if priority is None:
        pos = {i: k for k, i in enumerate(graph.topo_index)}
        priority = {op.id: float(n - pos[i]) for i, op in enumerate(graph.ops)}
    return Plan.build(graph, machine, {op.id: Assignment(device, threads, priority[op.id]) for op in graph.ops},
                      policy=policy)
