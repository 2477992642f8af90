"""Runtime models: what a real backend adds to a plan's run beyond the ops' own times.

The profiler times each op alone, called back to back on one thread with its
inputs, weights and code path hot; a runtime executing a plan runs every op
once, after other ops, hands ops between its threads and pays its own
bookkeeping.  None of that shows in a per-op profile, so each real backend has
a :class:`~opsched.engine.contracts.RuntimeModel`, fitted by ``opsched
profile`` on measured plans (``opsched.backends.runtime_fit``) and stored
beside the profiles; :class:`PlanningModel` joins it to a performance model,
and that one object is what apply, compare, train-policy and the benchmarks
plan with and the simulator prices (see "Runtime costs" in
:mod:`opsched.engine.sim`).

:class:`TorchCPURuntime` is the model of opsched's PyTorch CPU runtime
(``backends/executor.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from opsched.engine.contracts import PerfModel, RuntimeModel, TimeTable
from opsched.engine.models.record import RuntimeRecord
from opsched.engine.profiles import ProfileError
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine

_MIN_TIME = 1e-7
#: Op kinds whose CPU kernels (oneDNN, MKL) always run an OpenMP parallel region at > 1 thread.
PARALLEL_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Reference op time of :attr:`TorchCPURuntime.insitu_exp` (seconds).
INSITU_REF_S = 1e-4
#: ATen's ``internal::GRAIN_SIZE``: element-wise loops over fewer elements run on one thread.
ATEN_GRAIN_SIZE = 32768


@dataclass(frozen=True)
class TorchCPURuntime(RuntimeRecord):
    """The PyTorch CPU runtime's costs (seconds unless said; 0 or 1: neutral).

    * ``insitu_factor``: CPU op times are multiplied by it (1 = as profiled);
      ``insitu_exp`` makes it size-dependent: the profiled time ``t`` becomes
      ``insitu_factor * t * (t / 100 us) ** insitu_exp`` (< 0: small ops, whose
      code and caches a loop kept warm, slow down more in a run);
    * ``cold_byte_s``: seconds per byte of weights an op is the first in the
      run to read (:func:`cold_weight_bytes`); ``act_byte_s``: per byte of
      activations it reads and writes (``bytes_total - param_bytes``): in a
      loop they sat in the caches, in a run they come from memory;
      ``stream_overlap`` 1: the streams overlap the computation (an op takes
      ``max(compute, streams)``), 0: they add to it;
    * ``op_overhead_s``: then added to every CPU op (the executor's ready
      counters, slot pool and timing, and the cold dispatcher path);
    * ``thread_switch_s``: waking an idle OpenMP team (a multi-threaded op
      entering a parallel region after ops that used no team of its size);
    * ``team_overhead_s``: once two threads hold OpenMP teams the process has
      more OpenMP threads than cores and libgomp stops spin-waiting: a
      multi-threaded op is then no faster than on one thread, plus this;
    * ``host_s``: of each op's time, the part that holds the interpreter lock
      (co-running ops whose shares add up to more than 1 slow down);
      ``corun_c0``: a flat slowdown of ops that co-run;
    * ``handoff_s``: waking a sleeping executor thread an op is handed to;
    * ``spin_s``: how long an OpenMP team's helpers keep spinning on cores
      after a parallel region (libgomp's ``GOMP_SPINCOUNT``);
    * ``fitted_on``: what it was fitted on (graphs / plans), for the record.

    Fields absent from a saved file take their neutral value (older files load).
    """

    op_overhead_s: float = 0.0
    host_s: float = 0.0
    corun_c0: float = 0.0
    insitu_factor: float = 1.0
    thread_switch_s: float = 0.0
    team_overhead_s: float = 0.0
    cold_byte_s: float = 0.0
    act_byte_s: float = 0.0
    fitted_on: tuple[str, ...] = ()
    handoff_s: float = 0.0
    insitu_exp: float = 0.0
    stream_overlap: float = 1.0
    spin_s: float = 0.0

    name: ClassVar[str] = "torch-cpu-runtime"
    backend: ClassVar[str] = "torch-cpu"
    _FIELDS: ClassVar[tuple[str, ...]] = (
        "op_overhead_s", "host_s", "corun_c0", "insitu_factor", "thread_switch_s", "team_overhead_s",
        "cold_byte_s", "act_byte_s", "handoff_s", "insitu_exp", "stream_overlap", "spin_s")
    #: Fields that may be negative, and each field's value when a file lacks it.
    _SIGNED: ClassVar[frozenset[str]] = frozenset({"insitu_exp"})
    _DEFAULTS: ClassVar[dict[str, float]] = {"insitu_factor": 1.0, "stream_overlap": 1.0}

    # ----------------------------------------------------------- op times
    @staticmethod
    def opens_parallel_region(op: Op) -> bool:
        """Whether a multi-threaded run of ``op`` enters an OpenMP parallel region:
        library kernels (oneDNN convolutions, MKL GEMMs) always do; ATen's
        element-wise, reduction and normalisation loops only above its grain size."""
        if op.kind in PARALLEL_KINDS:
            return True
        return float(np.prod(op.shape)) >= ATEN_GRAIN_SIZE if op.shape else False

    def _cpu(self, t: float | np.ndarray, stream_s: float | np.ndarray) -> float | np.ndarray:
        """An op's time in a run from its profiled time ``t`` and the time
        ``stream_s`` to fetch what the profile had in cache."""
        if self.insitu_exp:
            tt = np.maximum(t, _MIN_TIME)
            t = np.where(np.isfinite(tt), tt * (tt / INSITU_REF_S) ** self.insitu_exp, tt)
        comp = self.insitu_factor * t
        if self.stream_overlap >= 1.0:
            return np.maximum(comp, stream_s) + self.op_overhead_s
        w = self.stream_overlap  # partial overlap: between the roofline's max and the plain sum
        return w * np.maximum(comp, stream_s) + (1.0 - w) * (comp + stream_s) + self.op_overhead_s

    def _act(self, op: Op) -> float:
        return self.act_byte_s * max(0.0, op.bytes_total - op.param_bytes)

    def op_time(self, op: Op, device: Device, alone_s: float) -> float:
        """``op`` in a run (without its graph: all its weights cold)."""
        if device.is_gpu:
            return alone_s
        return float(self._cpu(alone_s, self.cold_byte_s * op.param_bytes + self._act(op)))

    def op_times(self, graph: OpGraph, machine: Machine, table: TimeTable) -> TimeTable:
        """Every CPU op of ``graph`` in a run (GPU columns unchanged; missing levels stay inf)."""
        times = table.times.copy()
        stream = self.cold_byte_s * cold_weight_bytes(graph)
        stream += np.array([self._act(op) for op in graph.ops])
        for d, dev in enumerate(machine.devices):
            if not dev.is_gpu:
                times[:, d, :] = self._cpu(times[:, d, :], stream[:, None])
        return TimeTable(times, table.levels, table.device_ids)

    def corun_slowdown(self, device: Device, factors: Sequence[float], times: Sequence[float]) -> list[float]:
        """The performance model's co-run ``factors`` plus the flat co-run term and
        the interpreter lock's share, given each op's alone seconds ``times``."""
        f = [float(x) for x in factors]
        if device.is_gpu or len(f) < 2:
            return f
        f = [x + self.corun_c0 for x in f]
        h = self.host_s
        if h <= 0:
            return f
        share = [min(1.0, h / t) if t > 0 else 1.0 for t in times]
        over = sum(share) - 1.0
        if over <= 0:
            return f
        return [x + s * over for x, s in zip(f, share, strict=True)]

    # ------------------------------------------------------------ (de)serialise
    @classmethod
    def check_fields(cls, vals: dict[str, float], where: str) -> None:
        if not 0.0 <= vals["stream_overlap"] <= 1.0:
            raise ProfileError(f"{where}: runtime model field stream_overlap must lie in [0, 1], "
                               f"got {vals['stream_overlap']!r}")


class PlanningModel:
    """A performance model plus a real backend's runtime model: what a plan will
    take on that backend (the :class:`~opsched.engine.contracts.PerfModel`
    contract, with ``runtime`` set).  Op times and tables are the performance
    model's passed through the runtime model; co-run factors are the
    performance model's (the simulator adds the runtime's through
    ``runtime.corun_slowdown``)."""

    def __init__(self, perf: PerfModel, runtime: RuntimeModel) -> None:
        self.perf = perf
        self.runtime = runtime
        self.name = f"{perf.name}+{runtime.name}"
        self._tables: dict[tuple[str, str], TimeTable] = {}

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        return self.runtime.op_time(op, device, float(self.perf.op_time(op, device, threads)))

    def time_table(self, graph: OpGraph, machine: Machine) -> TimeTable:
        key = (graph.fingerprint(), machine.fingerprint())
        hit = self._tables.get(key)
        if hit is None:
            hit = self._tables[key] = self.runtime.op_times(graph, machine, self.perf.time_table(graph, machine))
        return hit

    def mem_demand(self, op: Op, device: Device, threads: int) -> float:
        return op.bytes_total / self.op_time(op, device, threads) / 1e9

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        return self.perf.slowdown(device, demands)

    def occupancy(self, op: Op, device: Device) -> float:
        return self.perf.occupancy(op, device)

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        return self.perf.transfer_time(nbytes, src, dst, machine)

    def __repr__(self) -> str:
        return f"PlanningModel({self.perf.name}, {self.runtime!r})"


def cold_weight_bytes(graph: OpGraph) -> np.ndarray:
    """Per op, the bytes of weights it is the first op of a run to read.

    An op's ``param_bytes`` counts every weight it reads; a weight read by
    several ops (an unrolled recurrent cell's, at every step) is fetched from
    memory once per run and then stays in the caches.  For an imported torch
    graph the weights are told apart by their value slots (``graph.source``);
    without a source every op's ``param_bytes`` counts.  An embedding lookup
    reads the rows it returns, not its whole table.  A graph saved with them
    (``meta["cold_weight_bytes"]``, see ``runtime_fit.save_record``) keeps them."""
    saved = graph.meta.get("cold_weight_bytes")  # a stored graph (runtime measurements) carries them
    if saved is not None and len(saved) == len(graph.ops):
        return np.asarray(saved, dtype=float)
    src = graph.source
    out = np.array([min(op.param_bytes, op.bytes_written) if op.kind == "embedding" else op.param_bytes
                    for op in graph.ops], dtype=float)
    const = getattr(src, "const_slots", None)
    if not const or not hasattr(src, "compile_ops"):
        return out
    try:
        values = src.new_values(*src.example_inputs)
        compiled = {c.op_id: c for c in src.compile_ops()}
    except Exception:  # a source that cannot rebuild its values: every op's own weights
        return out
    size = {s: float(values[s].numel() * values[s].element_size()) for s in const
            if hasattr(values[s], "element_size")}
    seen: set[int] = set()
    for i in graph.topo_index:
        c = compiled.get(graph.ops[i].id)
        if c is None:
            continue
        again = [s for s in c.reads if s in size and s in seen]
        seen.update(s for s in c.reads if s in size)
        out[i] = max(0.0, out[i] - sum(size[s] for s in again))
    return out


__all__ = ["ATEN_GRAIN_SIZE", "INSITU_REF_S", "PARALLEL_KINDS", "PlanningModel",
           "TorchCPURuntime", "cold_weight_bytes"]
