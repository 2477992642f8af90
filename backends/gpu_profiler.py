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
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np

from opsched.backends.profiler import _torch_source, compute_inputs
from opsched.engine.models.gpu import GPU_TIMER, gpu_cache_path
from opsched.engine.profiles import OpProfile, Profile, ProfileError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.progress import progress_bar


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
                repeats: int = 20, refresh: bool = False, cache_dir: str | Path | None | Literal[False] = None,
                budget_per_op_s: float = 0.05, link: bool = True, progress: bool = True,
                console: Any = None) -> Profile:
    """Measure every op of ``graph`` alone on GPU ``device`` (see the module docstring).

    ``machine`` defaults to ``Machine.probe()`` and must have ``device``; the
    result is cached in ``cache_dir`` (None: the per-user cache; False: no cache) and reused unless
    ``refresh``.  Raises :class:`ProfileError` without CUDA, for a GPU this
    process cannot see, or when an op fails on the GPU (naming it)."""
    torch, idx = _require_cuda(device)
    machine = machine or Machine.probe()
    gpu = machine.device(device)
    if not gpu.is_gpu:
        raise ProfileError(f"{device} of machine {machine.name!r} is not a GPU")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats}, warmup={warmup})")
    path = gpu_cache_path(graph, machine, device, cache_dir) if cache_dir is not False else None
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
    prof = Profile(graph.fingerprint(), graph.name, machine.hardware_fingerprint(), machine.name, asdict(gpu), (1,),
                   records, None, settings)
    if path is not None:
        prof.save(path)
    return prof


