"""The fitted performance model: measured profiles in, op times at any thread count out.

Liu et al. (IPDPS'19) predict an op's time at any intra-op thread count from
a few measured points with a lightweight model; this is that model, with the
same public API as :class:`~opsched.engine.models.analytic.AnalyticModel` so the
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
* **Co-run interference**: :class:`~opsched.engine.models.interference.InterferenceFit`
  refitted on every profile's measured pairs; the analytic term elsewhere.
* **Transfers**: bytes / link bandwidth + latency (the machine's links).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from opsched.cache import profiles_dir
from opsched.engine.contracts import RuntimeModel, TimeTable
from opsched.engine.models.analytic import KIND_SERIAL, AnalyticModel
from opsched.engine.models.interference import InterferenceFit, PairRecord, fit_interference
from opsched.engine.profiles import (
    OpProfile,
    Profile,
    ProfileError,
    load_profiles,
    op_signature,
)
from opsched.graph import Op, OpGraph
from opsched.machine import Device, Machine

_MIN_TIME = 1e-7


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
    #: The ops alone (a real runtime's costs: :class:`~opsched.engine.models.runtime.PlanningModel`).
    runtime: RuntimeModel | None = None

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
        r0 = self.neighbours[k0].residual(op.kind, x)
        assert r0 is not None  # level k0's neighbours know the kind (``known``)
        t0 = self.base.op_time(op, self.device, k0) * 10**r0
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

    def occupancy(self, op: Op, device: Device) -> float:
        """GPU compute share: the analytic model's (profiles are of the CPU)."""
        return self.base.occupancy(op, device)

    def transfer_time(self, nbytes: float, src: str, dst: str, machine: Machine) -> float:
        """Seconds to move ``nbytes`` across devices: bytes / link bandwidth + latency."""
        return machine.transfer_time(nbytes, src, dst)

    # ------------------------------------------------------------ loading
    @classmethod
    def from_cache(cls, machine: Machine | None = None, cache_dir: str | Path | None = None,
                   **kwargs: object) -> FittedModel:
        """Fit on every cached profile of ``machine`` (default: this machine)."""
        machine = machine or Machine.probe()
        profs = load_profiles(machine, cache_dir)
        if not profs:
            raise ProfileError(f"no profiles of machine {machine.name!r} ({machine.fingerprint()}) in "
                               f"{profiles_dir(cache_dir)}; run `opsched profile zoo:resnet50` (or any model) first")
        return cls(profs, **kwargs)  # type: ignore[arg-type]


