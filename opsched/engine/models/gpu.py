"""The GPU performance model: measured GPU op times (``opsched.backends.gpu_profiler``) where it has them.

GPU profiles are the profiler's :class:`~opsched.engine.profiles.Profile` files with
``settings["timer"] == GPU_TIMER`` (CUDA events), cached beside the CPU ones.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opsched.cache import profiles_dir
from opsched.engine.profiles import Profile, ProfileError, op_signature
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine

GPU_TIMER = "cuda-events"


def gpu_cache_path(graph: OpGraph, machine: Machine, device: str = "gpu:0",
                   cache_dir: str | Path | None = None) -> Path:
    """Where the GPU profile of ``graph`` on ``machine``'s ``device`` is cached."""
    return profiles_dir(cache_dir) / f"{graph.fingerprint()}_{machine.hardware_fingerprint()}_{device.replace(':', '')}.json"


def load_gpu_profiles(machine: Machine, cache_dir: str | Path | None = None) -> list[Profile]:
    """Every readable cached GPU profile of ``machine`` (unreadable ones skipped with a warning)."""
    out = []
    for p in sorted(profiles_dir(cache_dir).glob(f"*_{machine.hardware_fingerprint()}_gpu*.json")):
        try:
            prof = Profile.load(p)
        except ProfileError as exc:
            warnings.warn(f"skipping unreadable GPU profile: {exc}", stacklevel=2)
            continue
        if prof.settings.get("timer") == GPU_TIMER:
            out.append(prof)
    return out


# ----------------------------------------------------------------- the model
class GPUProfileModel:
    """A performance model that uses measured GPU op times where it has them.

    On a GPU of the profiled kind (same device name as a profile's device):
    an op of a profiled graph its own median; another op with the same
    ``(kind, shape, FLOPs, bytes)`` signature that median; any other op the
    base model's time scaled by its kind's measured / predicted ratio (the
    geometric mean over profiled ops; all kinds together for a kind never
    seen).  CPU<->GPU transfers use the measured link when a profile has one.
    Everything else - the CPU, other GPUs, co-run slowdown - is the ``base``
    model's (the analytic model by default; pass a ``FittedModel`` to use CPU
    measurements too).  Same API as ``AnalyticModel``.
    """

    name = "gpu-profiled"
    #: The ops alone: no real runtime's costs.
    runtime = None

    def __init__(self, profiles: Profile | Sequence[Profile], base: Any = None) -> None:
        from opsched.engine.models.analytic import default_model

        profs = [profiles] if isinstance(profiles, Profile) else list(profiles)
        if not profs:
            raise ProfileError("GPUProfileModel needs at least one GPU profile (run profile_gpu first)")
        for p in profs:
            if p.settings.get("timer") != GPU_TIMER or not p.device.get("kind") == "gpu":
                raise ProfileError(f"profile of {p.graph_name!r} ({p.machine_name}) is not a GPU profile "
                                   f"(timer {p.settings.get('timer')!r}, device kind {p.device.get('kind')!r})")
        self.base = base if base is not None else default_model()
        self.profiles = profs
        self.device_names = {str(p.device.get("name", "")) for p in profs}
        self._own: dict[tuple[str, str], float] = {}
        sig: dict[tuple, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        ref = Device(**profs[0].device)
        for p in profs:
            for o in p.ops.values():
                t = o.median[min(o.median)]
                self._own[(p.graph_fingerprint, o.id)] = t
                sig.setdefault(o.signature, []).append(t)
                op = Op(o.id, o.id, o.kind, o.flops, o.bytes_total, 0.0, 0.0, tuple(o.shape))
                pred = float(self.base.op_time(op, ref, 1))
                if pred > 0 and t > 0:
                    ratios.setdefault(o.kind, []).append(math.log(t / pred))
        self._sig = {k: float(np.median(v)) for k, v in sig.items()}
        every = [x for v in ratios.values() for x in v]
        self.kind_factor = {k: float(math.exp(np.mean(v))) for k, v in ratios.items()}
        self.kind_factor["*"] = float(math.exp(np.mean(every))) if every else 1.0
        links = [p.settings["link"] for p in profs if isinstance(p.settings.get("link"), Mapping)]
        self.link = {k: float(np.median([lk[k] for lk in links])) for k in links[0]} if links else None
        self._graph_fp: dict[int, str] = {}

    def matches(self, device: Device) -> bool:
        """True for a GPU of the profiled kind."""
        return device.is_gpu and device.name in self.device_names

    def _time(self, op: Op, device: Device, threads: int, graph_fp: str | None) -> float:
        if not self.matches(device):
            return float(self.base.op_time(op, device, threads))
        if graph_fp is not None:
            t = self._own.get((graph_fp, op.id))
            if t is not None:
                return t
        t = self._sig.get(op_signature(op))
        if t is not None:
            return t
        factor = self.kind_factor.get(op.kind, self.kind_factor["*"])
        return float(self.base.op_time(op, device, threads)) * factor

    def source(self, op: Op, device: Device, graph_fp: str | None = None) -> str:
        """Where a prediction comes from: measured, signature, scaled or base."""
        if not self.matches(device):
            return "base"
        if graph_fp is not None and (graph_fp, op.id) in self._own:
            return "measured"
        return "signature" if op_signature(op) in self._sig else "scaled"

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        """Seconds for ``op`` alone on ``device`` with ``threads``."""
        return self._time(op, device, int(threads), None)

    def time_table(self, graph: OpGraph, machine: Machine) -> Any:
        """The base model's table with the profiled GPUs' columns measured."""
        table = self.base.time_table(graph, machine)
        times = np.array(table.times, dtype=float, copy=True)
        fp = graph.fingerprint()
        for d, dev in enumerate(machine.devices):
            if self.matches(dev):
                times[:, d, 0] = [self._time(op, dev, 1, fp) for op in graph.ops]
        return dataclasses.replace(table, times=times)

    def mem_demand(self, op: Op, device: Device, threads: int) -> float:
        return op.bytes_total / self.op_time(op, device, threads) / 1e9

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(self.base.slowdown(device, demands), dtype=float), 1.0)

    def occupancy(self, op: Op, device: Device) -> float:
        return float(self.base.occupancy(op, device))

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        """Measured link for CPU<->profiled GPU copies, the machine's figures otherwise."""
        if self.link is not None and src != dst and "cpu" in (src, dst):
            gpu = machine.device(dst if src == "cpu" else src)
            if self.matches(gpu):
                way = "h2d" if src == "cpu" else "d2h"
                return self.link[f"{way}_latency_us"] * 1e-6 + nbytes / (self.link[f"{way}_gbs"] * 1e9)
        return float(self.base.transfer_time(nbytes, src, dst, machine))
