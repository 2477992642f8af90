"""The per-op performance model: how long an op takes on a device with k threads.

This module holds the *analytic* model, which needs no measurement: a roofline
(compute at the device's per-core peak, derated per op kind, against memory
traffic at the device's bandwidth) with Amdahl-style thread scaling and a
per-thread synchronisation overhead.  It gives a prediction for any op on any
preset machine, so the simulator runs everywhere.  ``opsched.backends.profiler``
fits the same functional form to measured times (see ``FittedModel``).

Public API every consumer relies on:

* ``model.op_time(op, device, threads) -> seconds`` (op alone on the device);
* ``model.time_table(graph, machine) -> TimeTable`` (all ops x devices x thread levels);
* ``model.transfer_time(nbytes, src, dst, machine) -> seconds``;
* ``model.mem_demand(op, device, threads) -> GB/s`` and
  ``model.slowdown(device, demands) -> factors >= 1`` (co-run interference);
* ``model.occupancy(op, device)``: the share of a GPU's compute an op fills
  (concurrent streams share the device beyond 1).
"""

from __future__ import annotations

import numpy as np

from opsched.engine.contracts import RuntimeModel, TimeTable
from opsched.graph import KIND_INDEX, OP_KINDS, Op, OpGraph
from opsched.machine import Device, Machine

#: Fraction of a device's peak FLOP/s an op of each kind reaches (single thread);
#: convolutions and GEMMs vectorise well, the rest mostly stream memory.
KIND_EFFICIENCY = {
    "conv": 0.55, "matmul": 0.65, "elementwise": 0.15, "pool": 0.2, "norm": 0.15,
    "concat_split": 0.1, "reduce": 0.2, "embedding": 0.1, "rnn": 0.4, "attention": 0.45, "other": 0.15,
}
#: Serial (non-parallelisable) fraction per kind, for Amdahl's law.
KIND_SERIAL = {
    "conv": 0.03, "matmul": 0.03, "elementwise": 0.08, "pool": 0.08, "norm": 0.12,
    "concat_split": 0.2, "reduce": 0.15, "embedding": 0.25, "rnn": 0.1, "attention": 0.06, "other": 0.2,
}


class AnalyticModel:
    """Roofline + Amdahl, from op features and the machine's nominal figures.

    t(k) = t_compute(1) * (s + (1 - s) / k)  maxed with  bytes / bw(k)
           + launch_overhead + sync_overhead * (k - 1)
    where bw(k) grows with k up to the device's bandwidth (one core cannot
    saturate a socket's memory system).
    """

    name = "analytic"
    #: The ops alone: no real runtime's costs (see :class:`~opsched.engine.models.runtime.PlanningModel`).
    runtime: RuntimeModel | None = None

    def __init__(self, launch_overhead_s: float = 4e-6, sync_overhead_s: float = 1.5e-6,
                 gpu_launch_s: float = 8e-6, single_core_bw_fraction: float = 0.25) -> None:
        self.launch_overhead_s = launch_overhead_s
        self.sync_overhead_s = sync_overhead_s
        self.gpu_launch_s = gpu_launch_s
        self.single_core_bw_fraction = single_core_bw_fraction

    def _bw(self, device: Device, threads: int) -> float:
        """Bytes/s available to an op on ``threads`` cores."""
        if device.is_gpu:
            return device.mem_bandwidth_gbs * 1e9
        frac = min(1.0, self.single_core_bw_fraction * threads)
        return max(frac, 1.0 / device.cores) * device.mem_bandwidth_gbs * 1e9

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        eff = KIND_EFFICIENCY.get(op.kind, 0.15)
        if device.is_gpu:
            compute = op.flops / (device.gflops * 1e9 * eff)
            memory = op.bytes_total / self._bw(device, 1)
            return max(compute, memory) + self.gpu_launch_s
        s = KIND_SERIAL.get(op.kind, 0.2)
        compute1 = op.flops / (device.gflops * 1e9 * eff)
        compute = compute1 * (s + (1.0 - s) / threads)
        memory = op.bytes_total / self._bw(device, threads)
        return max(compute, memory) + self.launch_overhead_s + self.sync_overhead_s * (threads - 1)

    def mem_demand(self, op: Op, device: Device, threads: int) -> float:
        """Memory bandwidth the op draws when alone (GB/s)."""
        return op.bytes_total / self.op_time(op, device, threads) / 1e9

    def occupancy(self, op: Op, device: Device) -> float:
        """The share of a GPU's compute one op fills when alone (0 on a CPU).

        Kernels on concurrent streams overlap only while their blocks leave
        room: ops whose occupancies add up to more than 1 share the device
        (the simulator slows them by the sum).  An op's share is the part of
        its time it computes (not waiting for memory or its launch) times how
        much of the device its output can spread over (one thread per output
        element, ``gflops / 100`` threads fill it: ~150k on a V100)."""
        if not device.is_gpu or op.flops <= 0:
            return 0.0
        eff = KIND_EFFICIENCY.get(op.kind, 0.15)
        compute = op.flops / (device.gflops * 1e9 * eff)
        elems = float(np.prod(op.shape)) if op.shape else 1.0
        width = min(1.0, elems / max(device.gflops / 100.0, 1.0))
        return float(min(1.0, compute / self.op_time(op, device, 1)) * width)

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        """Co-run interference: multiplicative slowdown of each op running
        together on ``device``, given each one's alone bandwidth demand (GB/s).

        When the demands add up to more than the device's bandwidth, each op's
        memory-bound share of its time stretches by the oversubscription (the
        seed paper's observation that co-running memory-bound ops interfere
        while compute-bound ones co-run almost for free)."""
        demands = np.asarray(demands, dtype=float)
        total = float(demands.sum())
        bw = device.mem_bandwidth_gbs
        if total <= bw or total <= 0:
            return np.ones_like(demands)
        mem_share = np.clip(demands / bw, 0.0, 1.0)
        return 1.0 + mem_share * (total / bw - 1.0)

    def time_table(self, graph: OpGraph, machine: Machine) -> TimeTable:
        levels = tuple(d.thread_levels() for d in machine.devices)
        width = max(len(lv) for lv in levels)
        times = np.full((len(graph.ops), len(machine.devices), width), np.inf)
        if type(self).op_time is not AnalyticModel.op_time:  # a subclass's own op_time, asked op by op
            for d, dev in enumerate(machine.devices):
                for k, t in enumerate(levels[d]):
                    times[:, d, k] = [self.op_time(op, dev, t) for op in graph.ops]
        else:
            ops = graph.ops
            flops = np.array([op.flops for op in ops], dtype=float)
            moved = np.array([op.bytes_total for op in ops], dtype=float)
            eff = np.array([KIND_EFFICIENCY.get(op.kind, 0.15) for op in ops])
            serial = np.array([KIND_SERIAL.get(op.kind, 0.2) for op in ops])
            for d, dev in enumerate(machine.devices):
                for k, t in enumerate(levels[d]):
                    times[:, d, k] = self._op_times(flops, moved, eff, serial, dev, t)
        return TimeTable(times, levels, tuple(dev.id for dev in machine.devices))

    def _op_times(self, flops: np.ndarray, moved: np.ndarray, eff: np.ndarray, serial: np.ndarray,
                  device: Device, threads: int) -> np.ndarray:
        """:meth:`op_time` of many ops at once (their FLOPs, bytes moved, kind
        efficiency and serial fraction), the same float operations in the same
        order, so equal to the last bit: planning a graph builds its time table
        first, and op by op that cost milliseconds."""
        compute = flops / (device.gflops * 1e9 * eff)
        if device.is_gpu:
            return np.maximum(compute, moved / self._bw(device, 1)) + self.gpu_launch_s
        compute = compute * (serial + (1.0 - serial) / threads)
        memory = moved / self._bw(device, threads)
        return np.maximum(compute, memory) + self.launch_overhead_s + self.sync_overhead_s * (threads - 1)

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        return machine.transfer_time(nbytes, src, dst)


def kind_one_hot(op: Op) -> np.ndarray:
    v = np.zeros(len(OP_KINDS))
    v[KIND_INDEX[op.kind]] = 1.0
    return v


def default_model() -> AnalyticModel:
    return AnalyticModel()
