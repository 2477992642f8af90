"""The per-op profiler: every op of an imported PyTorch graph, alone, on real tensors.

Why: the papers' schedulers (Liu et al.'s concurrency control, Graphi's
critical-path-first) rest on knowing each op's time at each intra-op thread
count.  ``profile_graph`` measures exactly that:

1. the graph runs once node by node (``TorchSource.compile_ops``) and keeps
   every value, so each op then has real input tensors of the right shapes;
2. each op is timed alone in the calling thread at every thread level of the
   machine's CPU (1, 2, 4, ... cores), ``warmup`` untimed calls then up to
   ``repeats`` timed calls per level, fewer for slow ops (a per-op time
   budget), interleaved in rounds over the levels so drift on a shared machine
   hits every level alike; the median and quartiles are kept;
3. optionally, pairs of ops run side by side to fit the co-run interference
   term (``opsched.backends.interference``).

Thread counts follow the facts measured for this runtime: ``torch.get_num_threads()``
is called before ``torch.set_num_threads(k)`` (the first op a thread runs can
reset it).  glibc's allocator hands large outputs fresh ``mmap`` pages that
page-fault on every call; :func:`configure_allocator` raises its thresholds
(recorded in the profile) so the op, not the kernel's page-fault path, is
timed - a runtime that wants times comparable to the profile applies it too.

A :class:`Profile` is plain JSON (never pickle), cached as
``runs/profiles/<graph fingerprint>_<machine fingerprint>.json`` with an
atomic write, and reused unless ``refresh=True``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime as _dt
import gc
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np

from opsched.engine.profiles import OpProfile, Profile, ProfileError, cache_path
from opsched.graph import Op, OpGraph
from opsched.machine import Machine
from opsched.progress import progress_bar
from opsched.timing import ContentionMeter

# --------------------------------------------------------------- allocator
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def configure_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> dict[str, Any]:
    """Stop glibc malloc from giving every large op output fresh, page-faulting
    ``mmap`` pages (and from trimming the heap after each free), process-wide.

    Respects ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` when the
    user set them.  Returns what was applied, for the profile's settings."""
    env = {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ}
    if env:
        return {"allocator": "glibc (environment)", **env}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {"allocator": "default (mallopt unavailable)"}
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    if not ok:
        return {"allocator": "default (mallopt refused)"}
    return {"allocator": "glibc mallopt", "mmap_threshold": int(mmap_threshold), "trim_threshold": int(trim_threshold)}


# --------------------------------------------------------------- measuring
def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def set_threads(k: int) -> None:
    """Set this thread's intra-op thread count (get first: the first op can reset it)."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(int(k))


@contextmanager
def _measuring() -> Iterator[None]:
    """no_grad, no GC pauses, and the caller's thread count restored afterwards."""
    import torch

    before = torch.get_num_threads()
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            yield
    finally:
        if gc_was:
            gc.enable()
        torch.set_num_threads(before)


def time_op(fn: Callable[[], Any], levels: Sequence[int], warmup: int = 3, repeats: int = 30,
            min_repeats: int = 5, budget_s: float = 0.08, rounds: int = 5
            ) -> tuple[dict[int, list[float]], dict[int, int]]:
    """Seconds per call of ``fn`` at each thread level, and how many rounds were dropped.

    ``warmup`` untimed calls per level; then ``n`` timed calls per level with
    ``n = clamp(budget_s / (levels x first-level time), min_repeats, repeats)``,
    split into up to ``rounds`` rounds that visit the levels in turn (after
    each switch one untimed call, for ops under a millisecond), so slow
    background drift affects all levels alike and switching costs stay out of
    the samples.  Each level's warm-up and rounds are time-boxed (at least one
    sample each), so a level slowed by preemption cannot stretch the profile.  A round whose median is more than twice the best round's
    (plus 5 µs) at that level is dropped: on a shared machine that is a
    helper thread preempted by another job, not the op."""
    perf = time.perf_counter
    box = budget_s / len(levels)  # time box per level, so a preempted level cannot run away
    for k in levels:
        set_threads(k)
        t_end = perf() + box / 4
        for _ in range(max(1, warmup)):
            fn()
            if perf() > t_end:
                break
    set_threads(levels[0])
    t0 = perf()
    fn()
    est = perf() - t0
    n = int(min(repeats, max(min_repeats, budget_s / max(est * len(levels), 1e-9))))
    rounds = max(1, min(rounds, n))
    per_round = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
    by_round: dict[int, list[list[float]]] = {k: [] for k in levels}
    for r, m in enumerate(per_round):
        order = levels if r % 2 == 0 else tuple(reversed(levels))
        for k in order:
            set_threads(k)
            if est < 1e-3:
                fn()
            ts: list[float] = []
            t_end = perf() + max(box / rounds, 2 * est * m)
            while len(ts) < m:
                t0 = perf()
                fn()
                t1 = perf()
                ts.append(t1 - t0)
                if t1 > t_end:
                    break
            by_round[k].append(ts)
    samples: dict[int, list[float]] = {}
    dropped: dict[int, int] = {}
    for k, rs in by_round.items():
        meds = [float(np.median(r)) for r in rs]
        limit = 2.0 * min(meds) + 5e-6
        kept = [r for r, m in zip(rs, meds, strict=True) if m <= limit]
        samples[k] = [t for r in kept for t in r]
        dropped[k] = len(rs) - len(kept)
    return samples, dropped


def load_cached(path: Path, graph: OpGraph, levels: Sequence[int], interference: bool) -> Profile | None:
    """The profile cached at ``path`` when it covers every op of ``graph`` at
    ``levels`` (and co-run interference when asked for), else None; a broken
    file is re-measured, with a warning."""
    if not path.exists():
        return None
    try:
        cached = Profile.load(path)
    except ProfileError as exc:
        warnings.warn(f"re-measuring: {exc}", stacklevel=3)
        return None
    if set(levels) <= set(cached.levels) and (cached.interference or not interference) \
            and set(cached.ops) == {op.id for op in graph.ops}:
        return cached
    return None


def compute_inputs(graph: OpGraph, compiled: Sequence[Any], values: list, where: str = "") -> None:
    """Run every compiled op once, in order, so each op's inputs exist in
    ``values`` before it is timed alone; an op that raises is named."""
    for c in compiled:
        try:
            c.run(values)
        except Exception as exc:
            raise ProfileError(f"graph {graph.name!r}: op {c.op_id!r} raised{where} while computing its inputs: "
                               f"{type(exc).__name__}: {exc}") from exc


def _torch_source(graph: OpGraph) -> Any:
    return graph.source_with(("compile_ops", "new_values", "example_inputs"), ProfileError,
                             "executable PyTorch source to profile",
                             "opsched.importers.torch_fx.from_torch or opsched.specs.load_graph")


def _op_callables(graph: OpGraph) -> tuple[dict[str, Callable[[], Any]], list]:
    """Run the graph once node by node, keep every value, and return a
    zero-argument callable per op that reruns it on its real inputs."""
    import torch

    src = _torch_source(graph)
    compiled = src.compile_ops()
    values = src.new_values(*src.example_inputs)
    with torch.no_grad():
        compute_inputs(graph, compiled, values)
    fns = {c.op_id: (lambda run=c.run: run(values)) for c in compiled}
    missing = [op.id for op in graph.ops if op.id not in fns]
    if missing:
        raise ProfileError(f"graph {graph.name!r}: its source has no runnable op for {missing[:5]}")
    return fns, values


def _levels_for(machine: Machine, threads: Sequence[int] | None) -> tuple[int, ...]:
    levels = tuple(sorted({int(k) for k in threads})) if threads else machine.cpu.thread_levels()
    avail = usable_cores()
    if not levels or levels[0] < 1:
        raise ProfileError(f"thread levels must be >= 1, got {list(levels)}")
    if levels[-1] > avail:
        raise ProfileError(f"cannot measure {levels[-1]} threads: this process may use {avail} CPUs "
                           f"(machine {machine.name!r} has {machine.cpu.cores} cores); pass threads=... "
                           "up to the usable CPUs, or profile on the machine itself")
    return levels


def _llc_bytes() -> float:
    """The last-level cache size from sysfs (32 MB when unknown)."""
    best = 0.0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        txt = f.read_text().strip().upper()
        try:
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1], 1)
            best = max(best, float(txt.rstrip("KMG")) * mult)
        except (ValueError, IndexError):
            continue
    return best or 32e6


def profile_graph(graph: OpGraph, machine: Machine | None = None, threads: Sequence[int] | None = None,
                  warmup: int = 3, repeats: int = 30, refresh: bool = False,
                  cache_dir: str | Path | None | Literal[False] = None, interference: bool = True,
                  budget_per_op_s: float = 0.08, progress: bool = True, console: Any = None,
                  tune_allocator: bool = True, max_attempts: int = 3, contention_limit: float = 0.25,
                  retry_budget_s: float = 10.0) -> Profile:
    """Measure every op of ``graph`` alone at each thread level (see the module docstring).

    ``machine`` defaults to ``Machine.probe()``; its CPU's ``thread_levels()``
    are measured unless ``threads`` names the levels.  The result is cached in
    ``cache_dir`` (None: the per-user cache, :func:`opsched.cache.profiles_dir`; False: no cache) and reused when it covers the requested
    levels (and interference, when asked) unless ``refresh``; an unreadable
    cache file is re-measured with a warning.

    On a shared machine, an op measured while other processes used more than
    ``contention_limit`` cores is measured again after the first pass, when
    the machine is quiet (up to ``max_attempts`` in all, within
    ``retry_budget_s`` seconds); the quietest attempt is kept and its load
    recorded (``OpProfile.others_cores``), so the model can tell measurements
    it should not trust at more than one thread."""
    machine = machine or Machine.probe()
    levels = _levels_for(machine, threads)
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got repeats={repeats}, warmup={warmup})")
    path = cache_path(graph, machine, cache_dir) if cache_dir is not False else None
    cached = load_cached(path, graph, levels, interference) if path is not None and not refresh else None
    if cached is not None:
        return cached
    _torch_source(graph)
    settings: dict[str, Any] = {"warmup": warmup, "repeats": repeats, "budget_per_op_s": budget_per_op_s}
    if tune_allocator:
        settings.update(configure_allocator())
    import torch

    settings.update(torch=torch.__version__, host=platform.node(),
                    created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    fns, _values = _op_callables(graph)
    records: dict[str, OpProfile] = {}

    def measure(op_id: str) -> tuple[float, dict[int, list[float]], dict[int, int]]:
        with ContentionMeter() as meter:
            try:
                samples, dropped = time_op(fns[op_id], levels, warmup, repeats, budget_s=budget_per_op_s)
            except Exception as exc:
                raise ProfileError(f"graph {graph.name!r}: op {op_id!r} raised while being profiled: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return meter.others_cores, samples, dropped

    def keep(op: Op, others: float, samples: dict[int, list[float]], dropped: dict[int, int]) -> None:
        old = records.get(op.id)
        if old is None or (others, sum(dropped.values())) < (old.others_cores, sum(old.dropped_rounds.values())):
            records[op.id] = OpProfile(op.id, op.kind, float(op.flops), float(op.bytes_total), tuple(op.shape),
                                       {k: tuple(v) for k, v in samples.items()}, others,
                                       {k: v for k, v in dropped.items() if v})

    with progress_bar(console=console, enabled=progress) as bar, _measuring():
        task = bar.add_task(f"profiling {graph.name}", total=len(graph.ops) + (1 if interference else 0))
        for op in graph.ops:
            bar.update(task, description=f"{graph.name}: {op.id}")
            keep(op, *measure(op.id))
            bar.advance(task)
        # Ops measured under load go again, later, when the machine is quiet.
        deadline = time.perf_counter() + retry_budget_s
        for attempt in range(1, max(1, max_attempts)):
            again = [op for op in graph.ops if records[op.id].others_cores > contention_limit
                     and (records[op.id].dropped_rounds or records[op.id].suspect_levels(contention_limit))]
            if not again or time.perf_counter() > deadline:
                break
            for op in again:
                if time.perf_counter() > deadline:
                    break
                bar.update(task, description=f"{graph.name}: re-measuring {op.id} (attempt {attempt + 1})")
                with ContentionMeter() as probe:
                    time.sleep(0.1)
                if probe.others_cores > contention_limit:
                    time.sleep(0.2)  # still busy: let the other job's burst pass
                    continue
                keep(op, *measure(op.id))
        inter = None
        if interference:
            bar.update(task, description=f"{graph.name}: co-run pairs")
            inter = _measure_interference(graph, machine, fns, records, levels[0], bar, task)
        bar.update(task, description=f"{graph.name}: done")
    prof = Profile(graph.fingerprint(), graph.name, machine.hardware_fingerprint(), machine.name, asdict(machine.cpu),
                   levels, records, inter, settings)
    if path is not None:
        prof.save(path)
    return prof


def _measure_interference(graph: OpGraph, machine: Machine, fns: Mapping[str, Callable[[], Any]],
                          records: Mapping[str, OpProfile], level: int, bar: Any, task: Any) -> dict[str, Any]:
    """Co-run pairs from the graph and synthetic kernels; fit the slowdown term."""
    from opsched.backends import interference as itf
    from opsched.engine.models import interference as itm

    threads = max(1, min(usable_cores(), machine.cpu.cores) // 2)
    cands = {op.id: (records[op.id].median[level], op.flops, op.bytes_total) for op in graph.ops
             if 50e-6 <= records[op.id].median[level] <= 20e-3}
    pairs = itf.choose_pairs(cands, per_class=3)
    kernels: dict[str, tuple[Callable[[], Any], float, float]] = {
        op_id: (fns[op_id], cands[op_id][1], cands[op_id][2]) for pair in pairs for op_id in pair}
    llc = _llc_bytes()
    synth = itf.synthetic_kernels(llc)
    kernels.update({f"synthetic:{k}": v for k, v in synth.items()})
    pairs += [("synthetic:gemm256", "synthetic:gemm256"), ("synthetic:stream_add", "synthetic:stream_add"),
              ("synthetic:gemm256", "synthetic:stream_add")]
    bar.update(task, total=bar.tasks[task].total + len(pairs))
    streams = min(usable_cores(), machine.cpu.cores)
    bw_one = itf.measure_bandwidth(1, llc_bytes=llc)
    bw_all = itf.measure_bandwidth(streams, llc_bytes=llc) if streams >= 2 else bw_one
    bar.advance(task)
    recs = itf.measure_pairs(kernels, pairs, threads=threads, on_pair=lambda: bar.advance(task)) \
        if usable_cores() >= 2 else []
    fit = itm.fit_interference(recs, bandwidth_gbs=max(bw_all, bw_one))
    return {"fit": fit.to_dict(), "threads_per_op": threads, "llc_bytes": llc,
            "bandwidth_gbs": {"one_stream": float(bw_one), "all_streams": float(bw_all)},
            "class_factors": itm.class_factors(recs),
            "pairs": [asdict(r) for r in recs]}
