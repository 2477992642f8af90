"""The co-run interference term of the performance model: how much ops co-running on one device slow each other.

Liu et al. (IPDPS'19) observe that co-running compute-bound ops costs almost
nothing while co-running memory-bound ops does not pay, because they fight
for the same memory bandwidth.  :mod:`opsched.backends.interference` measures
pairs of kernels side by side on the machine at hand; this module holds what
the measurements are fitted to, the slowdown term the simulator uses:

    s_i = 1 + c0 + gamma * min(1, d_i / B) * max(0, D / B - 1)      (two or more co-runners)

where ``d_i`` is op i's bandwidth demand when alone (bytes / alone time), ``D``
the sum of the demands of everything co-running on the device and ``B`` the
device's effective memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

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
        floats = {k: float(v) for k, v in data.items() if k != "n_pairs"}
        return cls(**floats, n_pairs=int(data.get("n_pairs", 0)))


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


def classify(flops: float, nbytes: float) -> str:
    return "compute" if flops / max(nbytes, 1.0) >= COMPUTE_BOUND_INTENSITY else "memory"


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
