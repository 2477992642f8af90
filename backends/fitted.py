"""The fitted performance model: measured profiles in, op times at any thread count out.

Liu et al. (IPDPS'19) predict an op's time at any intra-op thread count from
a few measured points with a lightweight model; this is that model, with the
same public API as :class:`~opsched.backends.perfmodel.AnalyticModel` so the
simulator and the schedulers take either.

* **A profiled op** (matched by op id within the profiled graph, else by its
  ``(kind, shape, FLOPs, bytes)`` signature, so a repeated block or another
  graph with the same layer shares the measurement): its measured median at a
  measured thread count; elsewhere Amdahl's law with a per-thread overhead,
  ``t(k) = a + b / k + c * (k - 1)``, fitted by non-negative least squares on
  relative errors through its measured points.  A profiled level the op lacks
  (not measured, or not trusted) is first imputed from its nearest measured
  level by how similar ops of its kind scale between the two (neighbours in
  size and shape), and the fit is regularised towards its kind's shape (the
  serial fraction and per-thread overhead fitted on all ops of the kind), which
  settles the parameters a 2-core machine's two levels leave free.
* **An op never profiled**, on the profiled CPU: the analytic time corrected by
  the measured/analytic ratio of its nearest profiled ops of the same kind
  (log FLOPs, log bytes, log reduction length), per measured thread level;
  the analytic model times the kind's machine factor for a kind never seen.
* **Another device** (a preset machine): the analytic model, scaled on CPUs by
  a per-kind machine factor (the geometric mean of measured / analytic times
  on the profiled CPU), which corrects the analytic model's systematic bias.
* **Co-run interference**: :class:`~opsched.backends.interference.InterferenceFit`
  refitted on every profile's measured pairs; the analytic term elsewhere.
* **Transfers**: bytes / link bandwidth + latency (the machine's links).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from opsched.backends.interference import InterferenceFit, PairRecord, fit_interference
from opsched.backends.perfmodel import KIND_SERIAL, AnalyticModel, TimeTable
from opsched.backends.profiler import (
    DEFAULT_CACHE_DIR,
    OpProfile,
    Profile,
    ProfileError,
    load_profiles,
    op_signature,
)
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine

_MIN_TIME = 1e-7
#: Op kinds whose CPU kernels (oneDNN, MKL) always run an OpenMP parallel region at > 1 thread.
PARALLEL_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Reference op time of :attr:`RuntimeCalibration.insitu_exp` (seconds).
INSITU_REF_S = 1e-4
#: ATen's ``internal::GRAIN_SIZE``: element-wise loops over fewer elements run on one thread.
ATEN_GRAIN_SIZE = 32768


# ------------------------------------------------------------------- Amdahl
@dataclass(frozen=True)
class Amdahl:
    """``t(k) = a + b / k + c * (k - 1)``: serial part, parallel part, per-thread overhead (seconds)."""

    a: float
    b: float
    c: float

    def __call__(self, k: float) -> float:
        return self.a + self.b / k + self.c * (k - 1)


def fit_amdahl(points: Mapping[int, float], prior: Amdahl | None = None, prior_weight: float = 0.05) -> Amdahl:
    """Non-negative least squares on relative errors of the measured ``{k: seconds}``.

    ``prior`` (when given) adds rows pulling ``(a, b, c)`` towards it with
    weight ``prior_weight`` relative to a measured point, which settles the
    directions the points leave free (2 points, 3 parameters) and barely moves
    a well-determined fit."""
    rows, rhs = [], []
    for k, t in points.items():
        w = 1.0 / max(t, _MIN_TIME)
        rows.append([w, w / k, w * (k - 1)])
        rhs.append(1.0)
    if prior is not None:
        scale = max(prior(1), _MIN_TIME)
        for j, v in enumerate((prior.a, prior.b, prior.c)):
            row = [0.0, 0.0, 0.0]
            row[j] = prior_weight / scale
            rows.append(row)
            rhs.append(prior_weight * v / scale)
    coef, _ = nnls(np.asarray(rows, dtype=float), np.asarray(rhs, dtype=float))
    return Amdahl(*(float(x) for x in coef))


@dataclass(frozen=True)
class KindShape:
    """How an op kind scales: serial fraction ``serial`` and per-thread overhead (seconds)."""

    serial: float
    overhead_s: float
    n_points: int = 0

    def prior_for(self, points: Mapping[int, float]) -> Amdahl:
        """The Amdahl curve of this shape through the op's measured points (on average)."""
        s, c = self.serial, self.overhead_s
        est = [max(t - c * (k - 1), _MIN_TIME) / (s + (1 - s) / k) for k, t in points.items()]
        t1 = float(np.median(est))
        return Amdahl(s * t1, (1 - s) * t1, c)


def fit_kind_shape(ops: Iterable[Mapping[int, float]]) -> KindShape | None:
    """Fit ``serial, overhead >= 0`` on every op's times relative to its lowest level:
    ``t_k - t_1 / k = serial * t_1 * (1 - 1/k) + overhead * (k - 1)`` (relative errors)."""
    rows, rhs = [], []
    for pts in ops:
        if 1 not in pts or len(pts) < 2:
            continue
        t1 = pts[1]
        for k, t in pts.items():
            if k == 1:
                continue
            w = 1.0 / max(t, _MIN_TIME)
            rows.append([w * t1 * (1 - 1 / k), w * (k - 1)])
            rhs.append(w * (t - t1 / k))
    if not rows:
        return None
    coef, _ = nnls(np.asarray(rows), np.asarray(rhs))
    return KindShape(serial=float(min(coef[0], 1.0)), overhead_s=float(coef[1]), n_points=len(rows))


# ------------------------------------------------------------ unseen ops
def op_features(flops: float, bytes_total: float, shape: Sequence[int]) -> np.ndarray:
    """log10 of FLOPs, bytes and the reduction length (FLOPs per output element:
    a depthwise convolution has a short one and reaches a fraction of a dense
    convolution's FLOP rate)."""
    return _op_features(float(flops), float(bytes_total), tuple(int(d) for d in shape))


@lru_cache(maxsize=1 << 16)
def _op_features(flops: float, bytes_total: float, shape: tuple[int, ...]) -> np.ndarray:
    out = float(np.prod(shape)) if shape else 1.0
    x = np.log10(1.0 + np.array([flops, bytes_total, flops / max(out, 1.0)]))
    x.flags.writeable = False
    return x


@dataclass(frozen=True)
class KindNeighbours:
    """Predicts an unprofiled op as the analytic time corrected by its profiled
    neighbours: the distance-weighted mean of ``log10(measured / analytic)``
    over the ``k`` nearest profiled ops of the same kind (standardised log
    features).  Why not a regression: across architectures a least-squares
    fit in log space extrapolates wildly (a transformer's matmuls predicted
    from CNN-only data), while a neighbour correction stays within what was
    measured and keeps the analytic model's scaling law between neighbours."""

    features: Mapping[str, np.ndarray]  # kind -> (n, 3) standardised features
    residuals: Mapping[str, np.ndarray]  # kind -> (n,) log10(measured / analytic)
    scale: Mapping[str, tuple[np.ndarray, np.ndarray]]  # kind -> (mean, std)
    k: int = 8

    def residual(self, kind: str, x: np.ndarray) -> float | None:
        if kind not in self.features:
            return None
        mu, sd = self.scale[kind]
        d = np.sqrt((((self.features[kind] - (x - mu) / sd)) ** 2).sum(axis=1))
        idx = np.argsort(d)[: self.k]
        w = 1.0 / (d[idx] + 0.05)
        return float(np.sum(w * self.residuals[kind][idx]) / w.sum())


def fit_neighbours(rows: Sequence[tuple[str, np.ndarray, float]], min_kind_ops: int = 3,
                   k: int = 8) -> KindNeighbours:
    """From ``(kind, features, target)`` rows; the target is averaged over neighbours."""
    by_kind: dict[str, list[tuple[np.ndarray, float]]] = {}
    for kind, x, r in rows:
        by_kind.setdefault(kind, []).append((x, r))
    feats, res, scale = {}, {}, {}
    for kind, items in by_kind.items():
        if len(items) < min_kind_ops:
            continue
        x = np.array([i[0] for i in items])
        mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-9
        feats[kind], res[kind], scale[kind] = (x - mu) / sd, np.array([i[1] for i in items]), (mu, sd)
    return KindNeighbours(feats, res, scale, k)


# -------------------------------------------------------------------- model
class FittedModel:
    """Per-op performance model fitted on measured profiles (see the module docstring).

    Arguments:
        profiles: one or more :class:`Profile` of the same machine.
        base: the analytic model used off the profiled device (default ``AnalyticModel()``).
        use_measured: return the measured median at measured thread counts
            (``False``: always the fitted curve, as the accuracy report does).
        prior_weight: pull of the kind shape on each op's Amdahl fit.
        min_kind_ops: profiled ops a kind needs before unprofiled ops of it are
            predicted from neighbours (else: analytic x machine factor).
        contention_limit: a multi-thread time measured while other processes
            used more than this many cores and over twice the one-thread time
            is not trusted (a preempted helper thread measures the scheduler,
            not the op); it is predicted instead.
    """

    name = "fitted"

    def __init__(self, profiles: Profile | Sequence[Profile], base: AnalyticModel | None = None,
                 use_measured: bool = True, prior_weight: float = 0.05, min_kind_ops: int = 3,
                 contention_limit: float = 0.25) -> None:
        profs = [profiles] if isinstance(profiles, Profile) else list(profiles)
        if not profs:
            raise ProfileError("FittedModel needs at least one profile (run `opsched profile MODEL` first)")
        ref = profs[0].cpu
        for p in profs[1:]:
            if not p.matches_device(ref):
                raise ProfileError(f"profiles of different machines: {profs[0].graph_name!r} was measured on "
                                   f"{ref.name!r} ({ref.cores} cores), {p.graph_name!r} on "
                                   f"{p.device.get('name')!r} ({p.device.get('cores')} cores)")
        self.profiles = profs
        self.base = base or AnalyticModel()
        self.use_measured = use_measured
        self.prior_weight = prior_weight
        self.contention_limit = contention_limit
        self._points: dict[int, dict[int, float]] = {}
        self.device = ref
        self.levels = tuple(sorted({k for p in profs for k in p.levels}))
        self._graph_ops: dict[str, Mapping[str, OpProfile]] = {p.graph_fingerprint: p.ops for p in profs}
        self._by_sig: dict[tuple, list[OpProfile]] = {}
        self._by_id_sig: dict[tuple[str, tuple], OpProfile] = {}
        for p in profs:
            for o in p.ops.values():
                self._by_sig.setdefault(o.signature, []).append(o)
                self._by_id_sig.setdefault((o.id, o.signature), o)
        self.min_kind_ops = min_kind_ops
        self._entries = [o for p in profs for o in p.ops.values()]
        self._fit_shapes()
        self._amdahl: dict[int, Amdahl] = {}
        self._scaling: dict[tuple[int, int], KindNeighbours | None] = {}
        self._cache: dict[tuple, float] = {}

    # ------------------------------------------------------------- fitting
    def points(self, o: OpProfile) -> dict[int, float]:
        """The op's trusted medians: all but :meth:`OpProfile.suspect_levels`."""
        hit = self._points.get(id(o))
        if hit is None:
            bad = o.suspect_levels(self.contention_limit)
            hit = self._points[id(o)] = {k: t for k, t in o.median.items() if k not in bad}
        return hit

    def _fit_shapes(self) -> None:
        by_kind: dict[str, list[Mapping[int, float]]] = {}
        for o in self._entries:
            by_kind.setdefault(o.kind, []).append(self.points(o))
        self.global_shape = fit_kind_shape(self.points(o) for o in self._entries)
        self.shapes: dict[str, KindShape] = {}
        for kind, meds in by_kind.items():
            shape = fit_kind_shape(meds)
            if shape is not None and shape.n_points >= 3:
                self.shapes[kind] = shape

    # The rest is fitted on first use: a model built only to look up measured
    # ops (or rebuilt many times by the accuracy report) does not pay for it.
    @cached_property
    def neighbours(self) -> dict[int, KindNeighbours]:
        """Per thread level: the neighbour model that predicts ops never profiled."""
        out = {}
        for k in self.levels:
            rows = []
            for o in self._entries:
                t = self.points(o).get(k)
                if t is not None:
                    base = self.base.op_time(self._as_op(o), self.device, k)
                    rows.append((o.kind, op_features(o.flops, o.bytes_total, o.shape), float(np.log10(t / base))))
            out[k] = fit_neighbours(rows, self.min_kind_ops)
        return out

    @cached_property
    def machine_factor(self) -> dict[str, float]:
        """Per kind (and ``"*"``): geometric mean of measured / analytic time on the profiled CPU."""
        ratios: dict[str, list[float]] = {}
        for o in self._entries:
            op = self._as_op(o)
            for k, t in self.points(o).items():
                ratios.setdefault(o.kind, []).append(np.log(t / self.base.op_time(op, self.device, k)))
        out = {kind: float(np.exp(np.median(r))) for kind, r in ratios.items()}
        all_r = [x for r in ratios.values() for x in r]
        out["*"] = float(np.exp(np.median(all_r))) if all_r else 1.0
        return out

    @cached_property
    def interference(self) -> InterferenceFit | None:
        """The co-run term refitted on every profile's measured pairs (None without pairs)."""
        recs, bws = [], []
        for p in self.profiles:
            inter = p.interference or {}
            for r in inter.get("pairs", []):
                recs.append(PairRecord(**r))
            bw = inter.get("bandwidth_gbs", {})
            bws += [float(v) for v in bw.values()]
        if not recs or not bws:
            return None
        return fit_interference(recs, bandwidth_gbs=max(bws))

    @staticmethod
    def _as_op(o: OpProfile) -> Op:
        return Op(o.id, o.id, o.kind, o.flops, o.bytes_total, 0.0, 0.0, tuple(o.shape))

    def shape_of(self, kind: str) -> KindShape:
        if kind in self.shapes:
            return self.shapes[kind]
        if self.global_shape is not None:
            return self.global_shape
        return KindShape(KIND_SERIAL.get(kind, 0.2), self.base.sync_overhead_s)

    def scaling(self, k_from: int, k_to: int) -> KindNeighbours | None:
        """How ops scale from level ``k_from`` to ``k_to``, ``log10(t_to /
        t_from)``, learned per kind from the ops measured at both, by
        neighbours in (log FLOPs, log bytes, log reduction length, log t_from).
        Why: ops of one kind differ in how they scale (a depthwise convolution
        barely does, a large GEMM nearly linearly); one serial fraction per
        kind misses that, ops of similar size and shape do not.  Fitted on
        first use of each pair (most plans need one pair or none, and planning
        pays for it)."""
        key = (k_from, k_to)
        if key not in self._scaling:
            rows = []
            for o in self._entries:
                pts = self.points(o)
                if k_from in pts and k_to in pts:
                    x = np.append(op_features(o.flops, o.bytes_total, o.shape), np.log10(pts[k_from]))
                    rows.append((o.kind, x, float(np.log10(pts[k_to] / pts[k_from]))))
            self._scaling[key] = fit_neighbours(rows, k=5)
        return self._scaling[key]

    def imputed(self, o: OpProfile) -> dict[int, float]:
        """The op's trusted points plus, for each profiled level it lacks, a
        time scaled from its nearest measured level by :attr:`scaling`."""
        pts = dict(self.points(o))
        if not pts:
            return pts
        x = op_features(o.flops, o.bytes_total, o.shape)
        for k in self.levels:
            if k in pts:
                continue
            k_from = min(self.points(o), key=lambda m: (abs(np.log2(m / k)), m))
            nb = self.scaling(k_from, k)
            r = nb.residual(o.kind, np.append(x, np.log10(pts[k_from]))) if nb is not None else None
            if r is not None:
                pts[k] = pts[k_from] * 10**r
        return pts

    def amdahl_for(self, o: OpProfile) -> Amdahl:
        """The op's Amdahl curve through its measured and imputed points (cached),
        regularised towards its kind's shape."""
        hit = self._amdahl.get(id(o))
        if hit is None:
            pts = self.imputed(o)
            hit = fit_amdahl(pts, self.shape_of(o.kind).prior_for(pts), self.prior_weight)
            self._amdahl[id(o)] = hit
        return hit

    # ---------------------------------------------------------- prediction
    def matches(self, device: Device) -> bool:
        """True for the profiled CPU (where measurements apply)."""
        return not device.is_gpu and (device.kind, device.cores, device.name, device.sockets, device.smt) == (
            self.device.kind, self.device.cores, self.device.name, self.device.sockets, self.device.smt)

    def _lookup(self, op: Op, graph_fp: str | None = None) -> list[OpProfile]:
        """The profiled entries for ``op`` that hold a trusted point (own id first, then same signature)."""
        if graph_fp is not None and graph_fp in self._graph_ops:
            hit = self._graph_ops[graph_fp].get(op.id)
            if hit is not None and self.points(hit):
                return [hit]
        sig = op_signature(op)
        own = self._by_id_sig.get((op.id, sig))
        if own is not None and self.points(own):
            return [own]
        return [o for o in self._by_sig.get(sig, []) if self.points(o)]

    def _profiled_time(self, entries: Sequence[OpProfile], threads: int) -> float:
        if self.use_measured:
            meds = [self.points(o)[threads] for o in entries if threads in self.points(o)]
            if meds:
                return float(statistics.median(meds))  # np.median's value, without its per-call cost
        return float(statistics.median([self.amdahl_for(o)(threads) for o in entries]))

    def _unseen_time(self, op: Op, threads: int) -> float | None:
        x = op_features(op.flops, op.bytes_total, op.shape)
        nb = self.neighbours.get(threads)
        r = nb.residual(op.kind, x) if nb is not None else None
        if r is not None:
            return self.base.op_time(op, self.device, threads) * 10**r
        known = [k for k, m in self.neighbours.items() if op.kind in m.features]
        if not known:
            return None
        k0 = min(known)  # extrapolate from the lowest level that knows the kind, along the kind's shape
        t0 = self.base.op_time(op, self.device, k0) * 10 ** self.neighbours[k0].residual(op.kind, x)
        return self.shape_of(op.kind).prior_for({k0: t0})(threads)

    def source(self, op: Op, device: Device, threads: int, graph_fp: str | None = None) -> str:
        """Where a prediction comes from: measured, amdahl, neighbours, analytic-scaled or analytic."""
        if device.is_gpu:
            return "analytic"
        if not self.matches(device):
            return "analytic-scaled"
        entries = self._lookup(op, graph_fp)
        if entries:
            measured = any(threads in self.points(o) for o in entries)
            return "measured" if self.use_measured and measured else "amdahl"
        return "neighbours" if self._unseen_time(op, threads) is not None else "analytic-scaled"

    def _time(self, op: Op, device: Device, threads: int, graph_fp: str | None) -> float:
        if device.is_gpu:
            return self.base.op_time(op, device, threads)
        if self.matches(device):
            entries = self._lookup(op, graph_fp)
            if entries:
                return max(self._profiled_time(entries, threads), _MIN_TIME)
            t = self._unseen_time(op, threads)
            if t is not None:
                return max(t, _MIN_TIME)
        factor = self.machine_factor.get(op.kind, self.machine_factor["*"])
        return self.base.op_time(op, device, threads) * factor

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        """Seconds for ``op`` alone on ``device`` with ``threads`` intra-op threads."""
        key = (op.id, op_signature(op), device, int(threads))
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = float(self._time(op, device, int(threads), None))
        return t

    def time_table(self, graph: OpGraph, machine: Machine) -> TimeTable:
        """All ops x devices x thread levels; ops of a profiled graph use their own measurement."""
        fp = graph.fingerprint()
        levels = tuple(d.thread_levels() for d in machine.devices)
        width = max(len(lv) for lv in levels)
        times = np.full((len(graph.ops), len(machine.devices), width), np.inf)
        for d, dev in enumerate(machine.devices):
            for k, t in enumerate(levels[d]):
                times[:, d, k] = [self._time(op, dev, t, fp) for op in graph.ops]
        return TimeTable(times, levels, tuple(dev.id for dev in machine.devices))

    def mem_demand(self, op: Op, device: Device, threads: int) -> float:
        """Memory bandwidth the op draws when alone (GB/s)."""
        return op.bytes_total / self.op_time(op, device, threads) / 1e9

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        """Co-run slowdown factors (>= 1): the fitted term on the profiled CPU, the analytic one elsewhere."""
        demands = np.asarray(demands, dtype=float)
        if self.interference is not None and self.matches(device):
            return np.maximum(self.interference.slowdown(demands), 1.0)
        return np.maximum(self.base.slowdown(device, demands), 1.0)

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        """Seconds to move ``nbytes`` across devices: bytes / link bandwidth + latency."""
        return machine.transfer_time(nbytes, src, dst)

    # ------------------------------------------------------------ loading
    @classmethod
    def from_cache(cls, machine: Machine | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                   **kwargs: object) -> FittedModel:
        """Fit on every cached profile of ``machine`` (default: this machine)."""
        machine = machine or Machine.probe()
        profs = load_profiles(machine, cache_dir)
        if not profs:
            raise ProfileError(f"no profiles of machine {machine.name!r} ({machine.fingerprint()}) in "
                               f"{cache_dir}; run `opsched profile zoo:resnet50` (or any model) first")
        return cls(profs, **kwargs)  # type: ignore[arg-type]


def fitted_or_analytic(machine: Machine | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR
                       ) -> FittedModel | AnalyticModel:
    """The fitted model when this machine has cached profiles, else the analytic one."""
    try:
        return FittedModel.from_cache(machine, cache_dir)
    except ProfileError:
        return AnalyticModel()


# ------------------------------------------------------------- real runtime
@dataclass(frozen=True)
class RuntimeCalibration:
    """What executing a whole plan on a real runtime adds to the profiled op times.

    The profiler times each op alone, called back to back on one thread with
    its inputs, weights and code path hot; a runtime executing a plan runs
    every op once, after other ops, and pays its own bookkeeping.  None of
    that shows in a per-op profile.  Fields (seconds unless said):

    * ``insitu_factor``: CPU op times are multiplied by it (>= 0; 1 = as
      profiled);
    * ``cold_byte_s``: seconds per byte of weights an op is the first in the
      run to read (:func:`cold_weight_bytes`): profiled in a loop they sit in
      the caches, in a run they come from memory - once per run, so a
      recurrent cell's weights, read at every step, count once;
    * ``act_byte_s``: seconds per byte of activations an op reads and writes
      (``bytes_total - param_bytes``): profiled in a loop they stay in the
      first-level caches, in a run an op's input was written by another op
      and its output is a fresh buffer;
    * the two streams overlap with the op's computation (hardware prefetch):
      an op in a run takes ``max(insitu_factor * t, cold_byte_s * cold +
      act_byte_s * activations)`` - a compute-bound convolution hides its
      weights' fetch, a small memory-bound op waits for it (a roofline whose
      memory side counts only what the profile had in cache);
    * ``op_overhead_s``: then added to every CPU op: the executor's ready
      counters, slot pool and timing, and the cold Python/dispatcher path of
      an op called once rather than in a loop;
    * ``thread_switch_s``: waking an idle OpenMP team: added to a
      multi-threaded CPU op that enters a parallel region
      (:meth:`CalibratedModel.opens_parallel_region`) when the last op started
      on its device did not use a team of that size (a one-thread op runs no
      parallel region; the helpers spin a while, then sleep on a futex, and
      the next parallel region must wake them);
    * ``team_overhead_s``: once two threads have each run a multi-threaded
      op, both hold OpenMP teams (the runtime gives every multi-threaded op
      to the calling thread, so this happens only when two of them run side
      by side); the process
      then has more OpenMP threads than cores, libgomp stops spin-waiting at
      its barriers, and a multi-threaded op is no faster than on one thread
      and pays for waking its team: one that enters a parallel region
      (:meth:`CalibratedModel.opens_parallel_region`) takes ``max(t(k), t(1))
      + team_overhead_s`` (measured here: a 2-thread convolution at its
      1-thread time plus ~35 us once a second team exists);
    * ``host_s``: of each op's time, the part that holds the interpreter lock
      (its GIL share is ``min(1, host_s / t)``); co-running ops whose shares
      add up to more than 1 slow down as the GIL is oversubscribed - the same
      law as memory bandwidth in :meth:`AnalyticModel.slowdown`;
    * ``corun_c0``: a flat slowdown of ops that co-run (shared caches,
      frequency, hand-offs between executor threads);
    * ``handoff_s``: waking a sleeping executor thread: the runtime's calling
      thread runs the multi-threaded ops, workers the one-thread ops, and an
      op started by a thread other than the one that runs it (a dependency
      that crosses between them, or a second co-running op) waits for its
      thread to wake (the simulator follows the runtime's rule: see
      "Hand-offs" in ``backends/sim.py``);
    * ``insitu_exp``: the in-situ factor depends on the op's size: the
      profiled time ``t`` becomes ``insitu_factor * t * (t / 100 us) **
      insitu_exp`` (0: one factor for all; < 0: small ops - whose code,
      branch history and caches a loop kept warm - slow down more in a run
      than big compute-bound ones);
    * ``stream_overlap``: 1 (default) when the memory streams overlap with
      the computation (the ``max`` above), 0 when they add to it;
    * ``spin_s``: how long an OpenMP team's helper threads keep spinning
      after a parallel region ends (libgomp's ``GOMP_SPINCOUNT``; ~8.4 ms
      measured here by ``bench/mixed_plans.py``): when a ``k``-thread op
      that entered a parallel region ends, ``k - 1`` cores stay busy until
      then or until the next parallel region starts, and the ops computing
      meanwhile share the other cores (the runtime runs such plans' workers
      unpinned, so they go where the kernel finds a core; see "OpenMP spin"
      in ``backends/sim.py``).  Not when several teams exist (libgomp then
      stops spinning: ``team_overhead_s``).  0: not modelled;
    * ``fitted_on``: what it was fitted on (models / plans), for the record.

    Fields absent from a saved calibration take their neutral value (older
    files load unchanged).
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

    _FIELDS = ("op_overhead_s", "host_s", "corun_c0", "insitu_factor", "thread_switch_s", "team_overhead_s",
               "cold_byte_s", "act_byte_s", "handoff_s", "insitu_exp",
               "stream_overlap", "spin_s")
    #: Fields that may be negative, and each field's value when a file lacks it.
    _SIGNED = frozenset({"insitu_exp"})
    _DEFAULTS = {"insitu_factor": 1.0, "stream_overlap": 1.0}

    def to_dict(self) -> dict[str, object]:
        return {**{k: getattr(self, k) for k in self._FIELDS}, "fitted_on": list(self.fitted_on)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object], where: str = "<dict>") -> RuntimeCalibration:
        try:
            vals = {k: float(data.get(k, cls._DEFAULTS.get(k, 0.0)))  # type: ignore[arg-type]
                    for k in cls._FIELDS}
            fitted_on = tuple(str(x) for x in data.get("fitted_on", ()))  # type: ignore[union-attr]
        except (TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: malformed runtime calibration: {exc}") from None
        bad = [k for k, v in vals.items() if not np.isfinite(v) or (v < 0 and k not in cls._SIGNED)]
        if bad:
            raise ProfileError(f"{where}: runtime calibration {bad[0]} must be a finite number"
                               f"{'' if bad[0] in cls._SIGNED else ' >= 0'}, got {vals[bad[0]]!r}")
        if not 0.0 <= vals["stream_overlap"] <= 1.0:
            raise ProfileError(f"{where}: runtime calibration stream_overlap must be 0 or 1 (or between), "
                               f"got {vals['stream_overlap']!r}")
        return cls(**vals, fitted_on=fitted_on)

    def save(self, path: str | Path) -> None:
        import json

        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RuntimeCalibration:
        import json

        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ProfileError(f"{p}: no such runtime calibration file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{p}: cannot read runtime calibration ({exc})") from None
        if not isinstance(data, Mapping):
            raise ProfileError(f"{p}: a runtime calibration is a JSON object")
        return cls.from_dict(data, where=str(p))


class CalibratedModel:
    """A performance model plus a :class:`RuntimeCalibration`: what the real
    runtime, not the op alone, will take (same API as the wrapped model).

    CPU op times become ``max(insitu_factor * t, cold_byte_s * cold_bytes(op) +
    act_byte_s * activation_bytes(op)) + op_overhead_s`` (``cold_bytes``: per
    op of a graph, default :func:`cold_weight_bytes`); the simulator adds
    ``thread_switch_s`` (:attr:`thread_switch_s`) to a multi-threaded op that
    must wake an idle OpenMP team and :attr:`team_overhead_s` to multi-threaded
    ops once two executor threads hold teams, keeps ``k - 1`` cores busy for
    :attr:`spin_s` after a ``k``-thread op's parallel region (the team's
    helpers spinning), and prices co-running CPU ops with
    the wrapped model's term plus the GIL and flat co-run terms (through
    :meth:`corun_slowdown`, called with each op's alone time).  GPU devices
    are passed through unchanged."""

    def __init__(self, base: object, calibration: RuntimeCalibration,
                 cold_bytes: Callable[[OpGraph], Sequence[float]] | None = None) -> None:
        self.base = base
        self.calibration = calibration
        self.cold_bytes = cold_bytes or cold_weight_bytes
        self.name = f"{getattr(base, 'name', type(base).__name__)}+runtime"
        self._tables: dict[tuple[str, str], TimeTable] = {}

    @property
    def thread_switch_s(self) -> float:
        return self.calibration.thread_switch_s

    @property
    def team_overhead_s(self) -> float:
        return self.calibration.team_overhead_s

    @property
    def handoff_s(self) -> float:
        return self.calibration.handoff_s

    @property
    def spin_s(self) -> float:
        return self.calibration.spin_s

    @staticmethod
    def opens_parallel_region(op: Op) -> bool:
        """Whether a multi-threaded run of ``op`` enters an OpenMP parallel region
        (and so pays :attr:`team_overhead_s` when throttled): library kernels
        (oneDNN convolutions, MKL GEMMs) always do; ATen's element-wise,
        reduction and normalisation loops only above its grain size."""
        if op.kind in PARALLEL_KINDS:
            return True
        return float(np.prod(op.shape)) >= ATEN_GRAIN_SIZE if op.shape else False

    def _cpu(self, t: float | np.ndarray, stream_s: float | np.ndarray) -> float | np.ndarray:
        """An op's time in a run from its profiled time ``t`` and the time
        ``stream_s`` to fetch what the profile had in cache (overlapped)."""
        c = self.calibration
        if c.insitu_exp:
            tt = np.maximum(t, _MIN_TIME)
            t = np.where(np.isfinite(tt), tt * (tt / INSITU_REF_S) ** c.insitu_exp, tt)
        comp = c.insitu_factor * t
        if c.stream_overlap >= 1.0:
            return np.maximum(comp, stream_s) + c.op_overhead_s
        # partial overlap: between the roofline's max and the plain sum
        w = c.stream_overlap
        return w * np.maximum(comp, stream_s) + (1.0 - w) * (comp + stream_s) + c.op_overhead_s

    def _act(self, op: Op) -> float:
        return self.calibration.act_byte_s * max(0.0, op.bytes_total - op.param_bytes)

    def op_time(self, op: Op, device: Device, threads: int) -> float:
        """Alone on ``device`` in a run (without the graph: all its weights cold)."""
        t = float(self.base.op_time(op, device, threads))  # type: ignore[attr-defined]
        if device.is_gpu:
            return t
        return float(self._cpu(t, self.calibration.cold_byte_s * op.param_bytes + self._act(op)))

    def time_table(self, graph: OpGraph, machine: Machine) -> TimeTable:
        key = (graph.fingerprint(), machine.fingerprint())
        hit = self._tables.get(key)
        if hit is None:
            base = self.base.time_table(graph, machine)  # type: ignore[attr-defined]
            times = base.times.copy()
            stream = self.calibration.cold_byte_s * np.asarray(self.cold_bytes(graph), dtype=float)
            stream += np.array([self._act(op) for op in graph.ops])
            for d, dev in enumerate(machine.devices):
                if not dev.is_gpu:  # inf (missing levels) stays inf
                    times[:, d, :] = self._cpu(times[:, d, :], stream[:, None])
            hit = self._tables[key] = TimeTable(times, base.levels, base.device_ids)
        return hit

    def mem_demand(self, op: Op, device: Device, threads: int) -> float:
        return op.bytes_total / self.op_time(op, device, threads) / 1e9

    def slowdown(self, device: Device, demands: np.ndarray) -> np.ndarray:
        """The wrapped term plus the flat co-run term (no GIL term: it needs the ops' times)."""
        f = np.asarray(self.base.slowdown(device, demands), dtype=float)  # type: ignore[attr-defined]
        if device.is_gpu or f.size < 2:
            return f
        return f + self.calibration.corun_c0

    def corun_slowdown(self, device: Device, demands: Sequence[float], times: Sequence[float]) -> list[float]:
        """Slowdown factors (>= 1) of ops co-running on ``device`` given each
        one's alone bandwidth demand (GB/s) and alone time (seconds)."""
        f = self.slowdown(device, np.asarray(demands, dtype=float))
        h = self.calibration.host_s
        if device.is_gpu or len(times) < 2 or h <= 0:
            return f.tolist()
        share = [min(1.0, h / t) if t > 0 else 1.0 for t in times]
        over = sum(share) - 1.0
        if over <= 0:
            return f.tolist()
        return [x + s * over for x, s in zip(f.tolist(), share, strict=True)]

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        return self.base.transfer_time(nbytes, src, dst, machine)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        # anything else (levels, source(), matches(), ...) is the wrapped model's
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


def cold_weight_bytes(graph: OpGraph) -> np.ndarray:
    """Per op, the bytes of weights it is the first op of a run to read.

    An op's ``param_bytes`` counts every weight it reads; a weight read by
    several ops (an unrolled recurrent cell's, at every step) is fetched from
    memory once per run and then stays in the caches.  For an imported torch
    graph the weights are told apart by their value slots (``graph.source``);
    without a source every op's ``param_bytes`` counts.  An embedding lookup
    reads the rows it returns, not its whole table."""
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
