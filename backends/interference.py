"""Co-run interference: how much two ops slow each other when they run side by side.

Liu et al. (IPDPS'19) observe that co-running compute-bound ops costs almost
nothing while co-running memory-bound ops does not pay, because they fight
for the same memory bandwidth.  This module measures that on the machine at
hand and fits the slowdown term the simulator uses:

    s_i = 1 + c0 + gamma * min(1, d_i / B) * max(0, D / B - 1)      (two or more co-runners)

where ``d_i`` is op i's bandwidth demand when alone (bytes / alone time), ``D``
the sum of the demands of everything co-running on the device and ``B`` the
device's effective bandwidth.  ``gamma`` scales the bandwidth-oversubscription
term of :meth:`AnalyticModel.slowdown` (gamma = 1, c0 = 0, B = nominal is the
analytic model), ``c0`` is the flat cost of sharing caches, frequency and the
Python interpreter lock.  With ``c0, gamma >= 0`` every factor is ``>= 1`` and
non-decreasing in any co-runner's demand.

Measurement: each op of a pair runs in its own worker thread at
``threads_per_op`` intra-op threads, looping for a fixed window after a common
barrier; the per-iteration median against the same op's median alone (measured
just before, in the same way) is its slowdown.  Pairs come from the profiled
graph (compute-bound + compute-bound, memory-bound + memory-bound, mixed) plus
synthetic kernels (a GEMM, a streaming add far larger than the last-level
cache) so every class is represented on any graph.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opsched.engine.models.interference import PairRecord, classify
from opsched.timing import ContentionMeter


# -------------------------------------------------------------- measurement
def _loop(fn: Callable[[], Any], threads: int, barrier: threading.Barrier, stop: list[float],
          out: list[float], err: list[BaseException]) -> None:
    try:
        import torch

        torch.get_num_threads()  # the first torch call can reset the count: do it before setting
        torch.set_num_threads(threads)
        with torch.no_grad():
            fn()  # warm this thread's caches and thread pool
            barrier.wait()  # its action sets the common deadline
            deadline = stop[0]
            ts = []
            while True:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                ts.append(t1 - t0)
                if t1 >= deadline and len(ts) >= 3:
                    break
        out.append(statistics.median(ts))
    except BaseException as exc:  # reported by the caller, never lost in a thread
        err.append(exc)
        barrier.abort()


def run_side_by_side(fns: Sequence[Callable[[], Any]], threads: int = 1, window_s: float = 0.15) -> list[float]:
    """Run each callable in its own worker thread for ``window_s`` after a common
    start; return each one's median time per call (seconds).  One callable
    measures it alone under the same conditions."""
    import torch

    torch.get_num_threads()
    main_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an idle main thread at k > 1 keeps spinning and steals a core
    stop: list[float] = []
    barrier = threading.Barrier(len(fns), action=lambda: stop.append(time.perf_counter() + window_s))
    outs: list[list[float]] = [[] for _ in fns]
    err: list[BaseException] = []
    workers = [threading.Thread(target=_loop, args=(f, threads, barrier, stop, o, err), daemon=True)
               for f, o in zip(fns, outs, strict=True)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(main_threads)
    if err:
        raise err[0]
    return [o[0] for o in outs]


def synthetic_kernels(llc_bytes: float = 32e6) -> dict[str, tuple[Callable[[], Any], float, float]]:
    """Named kernels (callable, flops, bytes) that are surely compute- or memory-bound."""
    import torch

    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    m = int(max(4 * llc_bytes, 64e6) / 12)  # three float32 streams, 4x the LLC
    x, y, z = torch.randn(m), torch.randn(m), torch.empty(m)
    return {
        "gemm256": (lambda: torch.mm(a, b), 2.0 * n**3, 3.0 * n * n * 4),
        # into a preallocated output: the memory system, not the allocator, is measured
        "stream_add": (lambda: torch.add(x, y, out=z), 0.0, 12.0 * m),
    }


def measure_bandwidth(threads: int, window_s: float = 0.2, llc_bytes: float = 32e6, attempts: int = 3) -> float:
    """Effective memory bandwidth (GB/s) with ``threads`` streaming adds side by
    side: the best of ``attempts`` (bandwidth is only ever under-measured)."""
    kernels = [synthetic_kernels(llc_bytes)["stream_add"] for _ in range(threads)]
    best = 0.0
    for _ in range(max(1, attempts)):
        times = run_side_by_side([k[0] for k in kernels], threads=1, window_s=window_s)
        best = max(best, float(sum(k[2] / t for k, t in zip(kernels, times, strict=True)) / 1e9))
    return best




def choose_pairs(candidates: Mapping[str, tuple[float, float, float]], per_class: int = 3) -> list[tuple[str, str]]:
    """Pairs of op ids by class from ``{id: (alone seconds, flops, bytes)}``:
    up to ``per_class`` compute+compute, memory+memory and mixed pairs, taken
    among the longest ops of each class (long ops time most stably)."""
    by_cls: dict[str, list[str]] = {"compute": [], "memory": []}
    for op_id, (_, flops, nbytes) in sorted(candidates.items(), key=lambda kv: -kv[1][0]):
        by_cls[classify(flops, nbytes)].append(op_id)
    c, m = by_cls["compute"][:per_class], by_cls["memory"][:per_class]
    pairs: list[tuple[str, str]] = []
    for group in (c, m):
        same = [(group[i], group[i + 1]) for i in range(len(group) - 1)] + [(g, g) for g in group[:1]]
        pairs += same[:per_class]
    pairs += list(zip(c, m, strict=False))[:per_class]
    return pairs


def measure_pairs(ops: Mapping[str, tuple[Callable[[], Any], float, float]], pairs: Sequence[tuple[str, str]],
                  threads: int = 1, window_s: float = 0.15, max_attempts: int = 3, contention_limit: float = 0.25,
                  on_pair: Callable[[], None] | None = None) -> list[PairRecord]:
    """Measure every pair of ``ops`` (``{name: (callable, flops, bytes)}``).

    A pair measured while other processes used more than ``contention_limit``
    cores is measured again (up to ``max_attempts``; the quietest attempt is kept)."""
    records = []
    for a, b in pairs:
        (fa, flops_a, bytes_a), (fb, flops_b, bytes_b) = ops[a], ops[b]
        best: tuple[float, tuple[float, float, float, float]] | None = None
        for _ in range(max(1, max_attempts)):
            with ContentionMeter() as meter:
                alone_a = run_side_by_side([fa], threads, window_s)[0]
                alone_b = run_side_by_side([fb], threads, window_s)[0] if b != a else alone_a
                corun_a, corun_b = run_side_by_side([fa, fb], threads, window_s)
            if best is None or meter.others_cores < best[0]:
                best = (meter.others_cores, (alone_a, alone_b, corun_a, corun_b))
            if meter.others_cores <= contention_limit:
                break
        alone_a, alone_b, corun_a, corun_b = best[1]  # type: ignore[index]
        ca, cb = classify(flops_a, bytes_a), classify(flops_b, bytes_b)
        cls = f"{ca}+{cb}" if ca == cb else "mixed"
        records.append(PairRecord(a, b, cls, alone_a, alone_b, corun_a, corun_b,
                                  bytes_a / alone_a / 1e9, bytes_b / alone_b / 1e9, best[0]))  # type: ignore[index]
        if on_pair:
            on_pair()
    return records








