"""The runtime model of the ``ort`` backend: what running a Plan as ONNX Runtime sessions adds.

The ONNX Runtime profile (``backends/ort_profiler.py``) gives each node's
kernel time inside a whole-graph run.  A lowered plan (``backends/ort_lower.py``)
adds what the simulator must price so that policies see that fine-grained
plans cost:

* ``op_overhead_s``: per node, the executor's own work around the kernel
  (it also carries each segment's share of a session launch - a ``run`` call
  from Python, binding its inputs and outputs - spread over its nodes);
  ``insitu_factor`` scales the profiled kernel times;
* ``handoff_s``: an op started on another thread than the one whose op just
  ended - in a lowered plan a new segment on another lane: a session launch
  and, when that lane was blocked on a cross-lane event, waking it;
* ``corun_c0``: a flat slowdown of co-running nodes (caches, memory, the
  interpreter lock of the Python parts), added to the performance model's
  bandwidth term;
* ``spin_s``: how long a session's intra-op pool keeps spinning on its cores
  after a parallel region (ONNX Runtime's ``allow_spinning``), which slows
  whatever runs on the other lanes meanwhile; ``thread_switch_s``: waking a
  sleeping pool (a multi-threaded node after one-thread ones);
* ``team_overhead_s`` is always 0: sessions own their pools, so several
  multi-threaded sessions at once do not throttle each other as OpenMP teams do.

The semantics of each field in the simulator are those of
:class:`~opsched.engine.contracts.RuntimeModel` (see "Runtime costs" in
:mod:`opsched.engine.sim`).  Fitted by ``opsched profile --backend ort`` on
measured plans (``backends/ort_fit.py``) and stored beside the PyTorch
runtime's model (``<profiles>/runtime/<machine>/ort.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from opsched.engine.contracts import TimeTable
from opsched.engine.models.record import RuntimeRecord
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine

#: Op kinds whose ONNX Runtime kernels (MLAS convolutions and GEMMs) split across the intra-op pool.
PARALLEL_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Element-wise and data-movement kernels below this many output elements run on one thread.
PARALLEL_MIN_ELEMENTS = 16384


@dataclass(frozen=True)
class OrtRuntime(RuntimeRecord):
    """The ``ort`` backend's costs (seconds unless said; 0 or 1: neutral; see the module docstring)."""

    op_overhead_s: float = 0.0
    insitu_factor: float = 1.0
    handoff_s: float = 0.0
    corun_c0: float = 0.0
    spin_s: float = 0.0
    thread_switch_s: float = 0.0
    fitted_on: tuple[str, ...] = ()

    name: ClassVar[str] = "ort-runtime"
    backend: ClassVar[str] = "ort"
    _FIELDS: ClassVar[tuple[str, ...]] = ("op_overhead_s", "insitu_factor", "handoff_s", "corun_c0", "spin_s",
                                          "thread_switch_s")
    _DEFAULTS: ClassVar[dict[str, float]] = {"insitu_factor": 1.0}
    _REMAKE: ClassVar[str] = "opsched profile --backend ort"

    @property
    def team_overhead_s(self) -> float:
        """Always 0: sessions own their pools (see the module docstring); a
        property, not a field, so it is neither saved nor fitted."""
        return 0.0

    @staticmethod
    def opens_parallel_region(op: Op) -> bool:
        """Whether a multi-threaded run of ``op`` uses its session's intra-op pool."""
        if op.kind in PARALLEL_KINDS:
            return True
        return float(np.prod(op.shape)) >= PARALLEL_MIN_ELEMENTS if op.shape else False

    def op_time(self, op: Op, device: Device, alone_s: float) -> float:
        if device.is_gpu:
            return alone_s
        return self.insitu_factor * alone_s + self.op_overhead_s

    def op_times(self, graph: OpGraph, machine: Machine, table: TimeTable) -> TimeTable:
        times = table.times.copy()
        for d, dev in enumerate(machine.devices):
            if not dev.is_gpu:
                times[:, d, :] = self.insitu_factor * times[:, d, :] + self.op_overhead_s
        return TimeTable(times, table.levels, table.device_ids)

    def corun_slowdown(self, device: Device, factors: Sequence[float], times: Sequence[float]) -> list[float]:
        f = [float(x) for x in factors]
        if device.is_gpu or len(f) < 2:
            return f
        return [x + self.corun_c0 for x in f]

    # ------------------------------------------------------------ (de)serialise


__all__ = ["PARALLEL_KINDS", "PARALLEL_MIN_ELEMENTS", "OrtRuntime"]
