"""GPU op times measured with CUDA events, in the profiler's :class:`Profile` format.

Why: the simulator and the schedulers price an op on a GPU with the
performance model; the analytic roofline only knows a preset's nominal
figures.  ``profile_gpu(graph, device="gpu:0")`` measures every op of an
imported PyTorch graph on that GPU so the model (:class:`GPUProfileModel`)
uses measured times there, as the CPU profiler does for the CPU.

How each op is timed (the same shape as ``backends/profiler.py``):

1. the module's parameters and buffers are copied to the GPU once and the
   graph runs node by node there, keeping every value, so each op has real
   inputs of the right shapes on the device;
2. each op alone, on the current stream: ``warmup`` untimed calls, then up to
   ``repeats`` calls (fewer for slow ops, a per-op time budget), each
   bracketed by a pair of timing events, one synchronisation for the batch;
   the samples go into the profile and the median is what the model uses.

What an event pair measures: the time from the device reaching the first
event to it reaching the second.  When the op's kernels take longer than the
host needs to launch them, the queue runs ahead and that is the kernels'
time; when the op is launch-bound (tiny kernels at batch 1) the device waits
for the host, and it is the host's launch time.  Both are what one op costs
a single-threaded issuing runtime, so both are what the simulator should see.
The host's own seconds per call (``perf_counter``) are kept too, in
``settings['launch_s']``.

The host<->device link is measured as well (pinned buffers, both directions,
a small and a large copy: latency and bandwidth) into ``settings['link']``;
:class:`GPUProfileModel` prices CPU<->GPU transfers with it.

A GPU profile is the same JSON as a CPU profile (``levels == (1,)``, the GPU
``Device`` as ``device``, ``settings['timer'] == 'cuda-events'``), cached as
``runs/profiles/<graph fp>_<machine fp>_gpu<i>.json`` - a name the CPU
profile loader (``load_profiles``) does not pick up, so the CPU's fitted
model never mistakes GPU times for CPU times.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from opsched.backends.profiler import (
    DEFAULT_CACHE_DIR,
    OpProfile,
    Profile,
    ProfileError,
    _torch_source,
    compute_inputs,
    op_signature,
)
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine
from opsched.progress import progress_bar

GPU_TIMER = "cuda-events"


def gpu_cache_path(graph: OpGraph, machine: Machine, device: str = "gpu:0",
                   cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """Where the GPU profile of ``graph`` on ``machine``'s ``device`` is cached."""
    return Path(cache_dir) / f"{graph.fingerprint()}_{machine.fingerprint()}_{device.replace(':', '')}.json"


def load_gpu_profiles(machine: Machine, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> list[Profile]:
    """Every readable cached GPU profile of ``machine`` (unreadable ones skipped with a warning)."""
    out = []
    for p in sorted(Path(cache_dir).glob(f"*_{machine.fingerprint()}_gpu*.json")):
        try:
            prof = Profile.load(p)
        except ProfileError as exc:
            warnings.warn(f"skipping unreadable GPU profile: {exc}", stacklevel=2)
            continue
        if prof.settings.get("timer") == GPU_TIMER:
            out.append(prof)
    return out


# --------------------------------------------------------------- measuring
def _require_cuda(device: str) -> tuple[Any, int]:
    import torch

    if not torch.cuda.is_available():
        raise ProfileError(f"profiling GPU ops needs CUDA, and torch {torch.__version__} sees no CUDA device here "
                           f"({'a CPU-only build' if torch.version.cuda is None else 'check the driver'}); "
                           "profile the CPU with `opsched profile` instead")
    if not (device.startswith("gpu:") and device[4:].isdigit()):
        raise ProfileError(f"GPU device must be 'gpu:<index>', got {device!r}")
    idx = int(device[4:])
    if idx >= torch.cuda.device_count():
        raise ProfileError(f"cannot profile {device}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return torch, idx


def time_op_cuda(fn: Callable[[], Any], warmup: int = 3, repeats: int = 20, min_repeats: int = 5,
                 budget_s: float = 0.05) -> tuple[list[float], list[float]]:
    """(event seconds per call, host seconds per call) of ``fn`` on the current stream.

    ``warmup`` untimed calls; then ``n = clamp(budget_s / first time, min_repeats,
    repeats)`` calls, each between two timing events, and one synchronisation."""
    import torch

    for _ in range(max(0, warmup)):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    est = max(a.elapsed_time(b) * 1e-3, 1e-7)
    n = int(min(repeats, max(min_repeats, budget_s / est)))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    host = []
    perf = time.perf_counter
    for s, e in pairs:
        t0 = perf()
        s.record()
        fn()
        e.record()
        host.append(perf() - t0)
    torch.cuda.synchronize()
    return [max(s.elapsed_time(e) * 1e-3, 1e-9) for s, e in pairs], host


def measure_link(index: int, small: int = 4 << 10, large: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    """Host<->GPU ``index`` copy latency (µs) and bandwidth (GB/s) each way, from
    pinned buffers timed with CUDA events: ``t(bytes) = latency + bytes / bandwidth``."""
    import torch

    dev = torch.device(f"cuda:{index}")
    out: dict[str, float] = {}
    with torch.cuda.device(dev):
        times: dict[tuple[str, int], float] = {}
        for size in (small, large):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            gpu = torch.empty(size, dtype=torch.uint8, device=dev)
            for name, (dst, src) in (("h2d", (gpu, host)), ("d2h", (host, gpu))):
                dst.copy_(src, non_blocking=True)  # warm-up
                samples = []
                for _ in range(repeats):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    dst.copy_(src, non_blocking=True)
                    b.record()
                    b.synchronize()
                    samples.append(a.elapsed_time(b) * 1e-3)
                times[(name, size)] = float(np.median(samples))
        for name in ("h2d", "d2h"):
            ts, tl = times[(name, small)], times[(name, large)]
            out[f"{name}_gbs"] = (large - small) / max(tl - ts, 1e-9) / 1e9
            out[f"{name}_latency_us"] = max(ts - small / (out[f"{name}_gbs"] * 1e9), 0.0) * 1e6
    return out


def profile_gpu(graph: OpGraph, machine: Machine | None = None, device: str = "gpu:0", warmup: int = 3,
                repeats: int = 20, refresh: bool = False, cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
                budget_per_op_s: float = 0.05, link: bool = True, progress: bool = True,
                console: Any = None) -> Profile:
    """Measure every op of ``graph`` alone on GPU ``device`` (see the module docstring).

    ``machine`` defaults to ``Machine.probe()`` and must have ``device``; the
    result is cached in ``cache_dir`` (``None``: no cache) and reused unless
    ``refresh``.  Raises :class:`ProfileError` without CUDA, for a GPU this
    process cannot see, or when an op fails on the GPU (naming it)."""
    torch, idx = _require_cuda(device)
    machine = machine or Machine.probe()
    gpu = machine.device(device)
    if not gpu.is_gpu:
        raise ProfileError(f"{device} of machine {machine.name!r} is not a GPU")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats}, warmup={warmup})")
    path = gpu_cache_path(graph, machine, device, cache_dir) if cache_dir is not None else None
    if path is not None and path.exists() and not refresh:
        try:
            cached = Profile.load(path)
            if cached.settings.get("timer") == GPU_TIMER and set(cached.ops) == {op.id for op in graph.ops}:
                return cached
        except ProfileError as exc:
            warnings.warn(f"re-measuring: {exc}", stacklevel=2)
    src = _torch_source(graph)
    dev = torch.device(f"cuda:{idx}")
    gm = copy.deepcopy(src.gm).to(dev)
    rsrc = dataclasses.replace(src, gm=gm, _compiled=None)
    compiled = rsrc.compile_ops()
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in src.example_inputs]
    records: dict[str, OpProfile] = {}
    launch: dict[str, float] = {}
    by_id = {op.id: op for op in graph.ops}
    with torch.no_grad(), torch.cuda.device(dev), progress_bar(console=console, enabled=progress) as bar:
        values = rsrc.new_values(*inputs)
        compute_inputs(graph, compiled, values, f" on {device}")
        torch.cuda.synchronize(dev)
        task = bar.add_task(f"profiling {graph.name} on {device}", total=len(compiled))
        for c in compiled:
            bar.update(task, description=f"{graph.name} on {device}: {c.op_id}")
            try:
                ev, host = time_op_cuda(lambda run=c.run: run(values), warmup, repeats,
                                        budget_s=budget_per_op_s)
            except Exception as exc:
                raise ProfileError(f"graph {graph.name!r}: op {c.op_id!r} raised on {device} while being "
                                   f"profiled: {type(exc).__name__}: {exc}") from exc
            op = by_id[c.op_id]
            records[op.id] = OpProfile(op.id, op.kind, float(op.flops), float(op.bytes_total), tuple(op.shape),
                                       {1: tuple(ev)})
            launch[op.id] = float(np.median(host))
            bar.advance(task)
        link_fig = measure_link(idx) if link else None
    settings: dict[str, Any] = {
        "timer": GPU_TIMER, "device": device, "cuda_device": torch.cuda.get_device_name(idx),
        "torch": torch.__version__, "cuda": torch.version.cuda, "warmup": warmup, "repeats": repeats,
        "budget_per_op_s": budget_per_op_s, "launch_s": launch,
    }
    if link_fig is not None:
        settings["link"] = link_fig
    prof = Profile(graph.fingerprint(), graph.name, machine.fingerprint(), machine.name, asdict(gpu), (1,),
                   records, None, settings)
    if path is not None:
        prof.save(path)
    return prof


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
        from opsched.backends.perfmodel import default_model

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
