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
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from opsched.timing import ContentionMeter

#: Arithmetic intensity (FLOPs per byte) from which an op counts as compute-bound.
COMPUTE_BOUND_INTENSITY = 4.0


@dataclass(frozen=True)
class InterferenceFit:
    """The fitted slowdown term (see the module docstring)."""

    bandwidth_gbs: float
    c0: float = 0.0
    gamma: float = 1.0
    rmse: float = 0.0  # of the fitted slowdowns on the measured pairs
    n_pairs: int = 0

    def slowdown(self, demands: np.ndarray | Sequence[float]) -> np.ndarray:
        """Multiplicative slowdown (>= 1) of each op co-running with the others."""
        d = np.asarray(demands, dtype=float)
        if d.size < 2:
            return np.ones_like(d)
        b = max(self.bandwidth_gbs, 1e-9)
        over = max(0.0, float(d.sum()) / b - 1.0)
        return 1.0 + self.c0 + self.gamma * np.clip(d / b, 0.0, 1.0) * over

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InterferenceFit:
        return cls(**{k: (int(v) if k == "n_pairs" else float(v)) for k, v in data.items()})


@dataclass(frozen=True)
class PairRecord:
    """One measured co-run: both ops' alone and co-run medians (seconds) and demands (GB/s)."""

    a: str
    b: str
    cls: str  # "compute+compute" | "memory+memory" | "mixed"
    alone_a: float
    alone_b: float
    corun_a: float
    corun_b: float
    demand_a: float
    demand_b: float
    others_cores: float = 0.0  # load from other processes while measured

    @property
    def slowdowns(self) -> tuple[float, float]:
        return self.corun_a / self.alone_a, self.corun_b / self.alone_b


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


def classify(flops: float, nbytes: float) -> str:
    return "compute" if flops / max(nbytes, 1.0) >= COMPUTE_BOUND_INTENSITY else "memory"


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


# --------------------------------------------------------------------- fit
def _rows(records: Sequence[PairRecord]) -> tuple[np.ndarray, np.ndarray]:
    d = np.array([[r.demand_a, r.demand_b] for r in records], dtype=float).reshape(-1, 2)
    s = np.array([r.slowdowns for r in records], dtype=float).reshape(-1, 2)
    return d, s


def fit_interference(records: Sequence[PairRecord], bandwidth_gbs: float) -> InterferenceFit:
    """Fit ``c0, gamma >= 0`` and the effective bandwidth ``B`` to the pairs.

    ``B`` is searched on a log grid around the measured bandwidth; for each
    ``B`` the term is linear in ``(c0, gamma)``, fitted with a robust (soft-L1)
    loss under non-negativity bounds, because one pair measured while another
    job grabbed a core must not decide the fit on a shared machine."""
    from scipy.optimize import least_squares

    if not records:
        return InterferenceFit(bandwidth_gbs=float(bandwidth_gbs), c0=0.0, gamma=1.0, rmse=float("nan"), n_pairs=0)
    d, s = _rows(records)
    y = (s - 1.0).ravel()
    best: tuple[float, float, float, float] | None = None
    for scale in np.geomspace(0.25, 4.0, 17):
        b = float(bandwidth_gbs * scale)
        over = np.maximum(0.0, d.sum(axis=1, keepdims=True) / b - 1.0)
        x_mem = (np.clip(d / b, 0.0, 1.0) * over).ravel()
        a = np.column_stack([np.ones_like(x_mem), x_mem])
        res = least_squares(lambda c, a=a: a @ c - y, x0=np.array([0.01, 0.5]), bounds=(0.0, np.inf),
                            loss="soft_l1", f_scale=0.05)
        cost = float(res.cost)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, b, float(res.x[0]), float(res.x[1]))
    _, b, c0, gamma = best  # type: ignore[misc]
    fit = InterferenceFit(bandwidth_gbs=b, c0=c0, gamma=gamma, n_pairs=len(records))
    err = predict_pairs(fit, records) - s
    return InterferenceFit(bandwidth_gbs=b, c0=c0, gamma=gamma, rmse=float(np.sqrt(np.mean(err**2))),
                           n_pairs=len(records))


def predict_pairs(fit: InterferenceFit, records: Sequence[PairRecord]) -> np.ndarray:
    """Predicted slowdowns, shape (pairs, 2)."""
    d, _ = _rows(records)
    return np.array([fit.slowdown(row) for row in d]).reshape(-1, 2)


def class_factors(records: Sequence[PairRecord]) -> dict[str, float]:
    """Median measured slowdown per pair class (the per-class factor view)."""
    out: dict[str, list[float]] = {}
    for r in records:
        out.setdefault(r.cls, []).extend(r.slowdowns)
    return {k: float(np.median(v)) for k, v in out.items()}
