"""NN Maestro: layer scheduling for inference on multi-GPU systems.

The paper's pipeline, step by step, and how each step is read here:

1. **Does multi-GPU pay off?**  A pre-trained SVM classifier looks at the
   graph (and the machine) and answers yes or no.  Ours is an RBF-kernel SVM
   over six features (:data:`FEATURES`), trained with scikit-learn's ``SVC``
   against *simulated* outcomes (label: the multi-GPU schedule below is at
   least :data:`PAYOFF` faster than the single-GPU one) by
   ``opsched maestro-train``.  It ships as plain JSON (``maestro_svm.json``:
   scaler, support vectors, dual coefficients, intercept, gamma) and its
   decision function is evaluated here in numpy -- no pickle, no sklearn at
   run time.  If the answer is no, every layer runs on GPU 0.
2. **Scheduling order**: a topological sort (by depth level), and within a
   level the layers with the larger *significance cost* first; we take a
   layer's significance to be its mean compute time over the GPUs plus the
   time to ship its outputs across a GPU link -- what a bad placement of it
   would cost.  Heaviest-first inside a level is also what balances the load.
3. **Placement**: each layer, in that order, goes to the GPU with the lowest
   *placement cost* = its compute time there + the communication from every
   predecessor placed on another GPU + the compute already placed on that GPU
   in the current group (layers of a group share their GPU's time).
4. **Grouping**: consecutive layers of the order with no dependency between
   them form a group that runs in parallel across the GPUs.

Each GPU runs its layers one at a time in the scheduling order (one stream,
an ``after`` chain); cross-GPU edges become transfers priced by the backend.
On a machine with fewer than two GPUs there is nothing to place: the graph
runs in the scheduling order on the single default device (GPU 0, or the CPU
with all its cores).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.errors import PolicyError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import Policy, build_plan, default_device, full_threads, lane_after, resolve_model
from opsched.policies.registry import BASELINE, HINT, TEACHER, register

SVM_FORMAT = "opsched.maestro-svm"
SVM_FORMAT_VERSION = 1
DEFAULT_SVM_PATH = Path(__file__).with_name("maestro_svm.json")
#: The classifier's inputs, in order.
FEATURES = (
    "log10_ops",          # graph size
    "log10_parallelism",  # total GPU work / critical path at GPU op times
    "log10_level_width",  # the widest depth level
    "log10_comm_comp",    # mean edge transfer between GPUs / mean op time on a GPU
    "n_gpus",
    "log10_op_us",        # mean op time on a GPU, microseconds (granularity)
)
#: Multi-GPU "pays off" when it is at least this much faster than one GPU.
PAYOFF = 0.05


# ------------------------------------------------------------------ features
def maestro_features(graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> np.ndarray:
    """The feature vector :data:`FEATURES` for ``graph`` on ``machine``."""
    model = resolve_model(model)
    n = len(graph.ops)
    gpus = machine.gpus
    dev = gpus[0] if gpus else machine.cpu
    t = np.array([model.op_time(op, dev, full_threads(dev)) for op in graph.ops])
    total = float(t.sum())
    cp = graph.critical_path(t)[0] if n else 0.0
    width = int(np.bincount(np.asarray(graph.levels)).max()) if n else 0
    if len(gpus) >= 2:
        comm = [model.transfer_time(b, gpus[0].id, gpus[1].id, machine) for b in graph.edge_bytes.values()]
    else:
        comm = []
    mean_comm = float(np.mean(comm)) if comm else 0.0
    mean_op = total / max(n, 1)
    return np.array([
        math.log10(max(n, 1)),
        math.log10(max(total, 1e-12) / max(cp, 1e-12)),
        math.log10(max(width, 1)),
        math.log10(max(mean_comm, 1e-9) / max(mean_op, 1e-9)),
        float(len(gpus)),
        math.log10(max(mean_op * 1e6, 1e-3)),
    ])


# -------------------------------------------------------------- classifier
@dataclass(frozen=True)
class MaestroSVM:
    """An RBF-kernel SVM decision function in numpy, read from JSON.

    ``decision(x) = sum_k dual_coef[k] * exp(-gamma * |z - sv[k]|^2) + intercept``
    with ``z = (x - mean) / scale``; positive means "use several GPUs"."""

    mean: np.ndarray
    scale: np.ndarray
    support_vectors: np.ndarray
    dual_coef: np.ndarray
    intercept: float
    gamma: float
    meta: dict

    def decision(self, x: np.ndarray) -> float:
        z = (np.asarray(x, dtype=float) - self.mean) / self.scale
        d2 = ((self.support_vectors - z) ** 2).sum(axis=1)
        return float(self.dual_coef @ np.exp(-self.gamma * d2) + self.intercept)

    def multi_gpu(self, x: np.ndarray) -> bool:
        return self.decision(x) > 0.0

    def to_dict(self) -> dict:
        return {
            "format": SVM_FORMAT, "version": SVM_FORMAT_VERSION, "features": list(FEATURES),
            "kernel": "rbf", "gamma": self.gamma, "intercept": self.intercept,
            "scaler_mean": self.mean.tolist(), "scaler_scale": self.scale.tolist(),
            "support_vectors": self.support_vectors.tolist(), "dual_coef": self.dual_coef.tolist(),
            "positive_class": "multi_gpu", "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path = DEFAULT_SVM_PATH) -> MaestroSVM:
        """Read and check a classifier file; any problem is a :class:`PolicyError`
        naming the file."""
        from opsched.io import read_json

        p = Path(path)
        data = read_json(p, PolicyError, "Maestro classifier", missing=" (train one with `opsched maestro-train`)")
        if not isinstance(data, dict) or data.get("format") != SVM_FORMAT:
            raise PolicyError(f"{p}: not a Maestro classifier (missing format {SVM_FORMAT!r})")
        if data.get("version") != SVM_FORMAT_VERSION:
            raise PolicyError(f"{p}: Maestro classifier version {data.get('version')!r} is not supported "
                              f"(this opsched reads version {SVM_FORMAT_VERSION})")
        if data.get("features") != list(FEATURES) or data.get("kernel") != "rbf":
            raise PolicyError(f"{p}: classifier features/kernel {data.get('features')!r}/{data.get('kernel')!r} "
                              f"differ from this opsched's {list(FEATURES)}/rbf; retrain it")
        try:
            svm = cls(
                mean=np.asarray(data["scaler_mean"], dtype=float),
                scale=np.asarray(data["scaler_scale"], dtype=float),
                support_vectors=np.asarray(data["support_vectors"], dtype=float),
                dual_coef=np.asarray(data["dual_coef"], dtype=float),
                intercept=float(data["intercept"]),
                gamma=float(data["gamma"]),
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PolicyError(f"{p}: malformed Maestro classifier: {exc!r}") from None
        k = len(FEATURES)
        sv = svm.support_vectors
        if (svm.mean.shape != (k,) or svm.scale.shape != (k,) or sv.ndim != 2 or sv.shape[1] != k
                or svm.dual_coef.shape != (sv.shape[0],) or sv.shape[0] == 0):
            raise PolicyError(f"{p}: Maestro classifier arrays have inconsistent shapes "
                              f"(mean {svm.mean.shape}, scale {svm.scale.shape}, support vectors {sv.shape}, "
                              f"dual_coef {svm.dual_coef.shape}; {k} features)")
        arrays = (svm.mean, svm.scale, sv, svm.dual_coef, np.array([svm.intercept, svm.gamma]))
        if not all(np.all(np.isfinite(a)) for a in arrays) or np.any(svm.scale <= 0) or svm.gamma <= 0:
            raise PolicyError(f"{p}: Maestro classifier holds non-finite or non-positive values")
        return svm


# ------------------------------------------------------------- scheduling
def scheduling_order(graph: OpGraph, significance: np.ndarray) -> list[int]:
    """Topological sort by depth level; inside a level, higher significance first."""
    levels = graph.levels
    return sorted(range(len(graph.ops)), key=lambda i: (levels[i], -significance[i], i))


def group_layers(graph: OpGraph, order: Sequence[int]) -> list[list[int]]:
    """Split the order into runs of consecutive, mutually independent layers."""
    groups: list[list[int]] = []
    current: set[int] = set()
    for i in order:
        if not groups or any(p in current for p in graph.pred_index[i]):
            groups.append([])
            current = set()
        groups[-1].append(i)
        current.add(i)
    return groups


def place_layers(graph: OpGraph, machine: Machine, model: PerfModel, gpu_ids: Sequence[str],
                 comp: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """Each layer to the GPU with the lowest placement cost; returns GPU positions."""
    edge_bytes = graph.edge_bytes
    where = np.full(len(graph.ops), -1, dtype=int)
    for group in groups:
        load = np.zeros(len(gpu_ids))
        for i in group:
            cost = comp[i] + load
            for p in graph.pred_index[i]:
                nbytes = edge_bytes[p, i]
                for g, gid in enumerate(gpu_ids):
                    if where[p] != g:
                        cost[g] += model.transfer_time(nbytes, gpu_ids[int(where[p])], gid, machine)
            g = int(np.argmin(cost))
            where[i] = g
            load[g] += comp[i, g]
    return where


@register("maestro", roles=(BASELINE, HINT, TEACHER), order=5)
class Maestro(Policy):
    """NN Maestro (see the module docstring)."""

    name = "maestro"

    def __init__(self, svm_path: str | Path | None = None, force: bool | None = None) -> None:
        self.svm_path = Path(svm_path) if svm_path else DEFAULT_SVM_PATH
        self.force = force  # True / False skip the classifier (used for training labels)
        self._svm: MaestroSVM | None = None

    @property
    def svm(self) -> MaestroSVM:
        if self._svm is None:
            self._svm = MaestroSVM.load(self.svm_path)
        return self._svm

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        model = resolve_model(model)
        gpus = machine.gpus
        n_gpus = len(gpus)
        devices = list(gpus) if gpus else [machine.cpu]
        comp = np.array([[model.op_time(op, d, full_threads(d)) for d in devices] for op in graph.ops])
        comp = comp.reshape(len(graph.ops), len(devices))
        significance = comp.mean(axis=1)
        if n_gpus >= 2:
            out_bytes = np.zeros(len(graph.ops))
            for (src, _), nbytes in graph.edge_bytes.items():
                out_bytes[src] += nbytes
            significance = significance + np.array(
                [model.transfer_time(b, gpus[0].id, gpus[1].id, machine) if b else 0.0 for b in out_bytes])
        order = scheduling_order(graph, significance)
        meta: dict[str, Any] = {}
        multi = False
        if n_gpus >= 2:
            if self.force is None:
                score = self.svm.decision(maestro_features(graph, machine, model))
                meta["svm_decision"] = score
                multi = score > 0.0
            else:
                multi = self.force
        if multi:
            groups = group_layers(graph, order)
            where = place_layers(graph, machine, model, [g.id for g in gpus], comp, groups)
            placed = [gpus[g] for g in where]
            meta["groups"] = len(groups)
        else:
            placed = [default_device(machine)] * len(graph.ops)
        lanes: dict[str, list[int]] = {}
        for i in order:
            lanes.setdefault(placed[i].id, []).append(i)
        after = lane_after(graph, list(lanes.values()))
        n = len(order)
        pos = {i: k for k, i in enumerate(order)}
        assignments = {op.id: Assignment(placed[i].id, full_threads(placed[i]), float(n - pos[i]), after[i])
                       for i, op in enumerate(graph.ops)}
        return build_plan(graph, machine, assignments, policy=self.name, multi_gpu=multi,
                          devices_used=sorted(lanes), **meta)


# ---------------------------------------------------------------- training
#: The multi-GPU presets of the NN Maestro paper (2x 2080Ti, 4x V100, 4x A6000).
GPU_PRESETS = ("2x2080ti", "dgx1-4v100", "4xa6000")


def training_families() -> list[tuple[str, dict[str, float]]]:
    """(synthetic family, options) of the training graphs: every family, plus
    near-chains and very wide layered graphs so both answers are well covered."""
    from opsched.synthetic import FAMILIES

    out: list[tuple[str, dict[str, float]]] = [(f, {}) for f in FAMILIES]
    if "layered" in FAMILIES:
        out += [("layered", {"mean_width": 1.0}), ("layered", {"mean_width": 8.0})]
    return out


def scale_graph(graph: OpGraph, factor: float) -> OpGraph:
    """The graph at ``factor`` times the batch: FLOPs, activation bytes and edge
    bytes scale, weights do not (a cheap way to cover many batch sizes)."""
    from dataclasses import replace

    from opsched.graph import Edge

    ops = [replace(op, flops=op.flops * factor, bytes_written=op.bytes_written * factor,
                   bytes_read=op.param_bytes + (op.bytes_read - op.param_bytes) * factor) for op in graph.ops]
    edges = [Edge(e.src, e.dst, e.bytes * factor) for e in graph.edges]
    return OpGraph(tuple(ops), tuple(edges), name=f"{graph.name}*{factor:g}",
                   meta={**graph.meta, "scale": factor})


def label_sample(graph: OpGraph, machine: Machine,
                 model: PerfModel | None = None) -> tuple[np.ndarray, float, float]:
    """(features, multi-GPU makespan, single-GPU makespan), both simulated."""
    from opsched.engine.sim import Simulator

    model = resolve_model(model)
    sim = Simulator(machine, model=model)
    multi = sim.makespan(graph, Maestro(force=True).plan(graph, machine, model))
    single = sim.makespan(graph, Maestro(force=False).plan(graph, machine, model))
    return maestro_features(graph, machine, model), float(multi), float(single)


def pays_off(multi: float, single: float) -> bool:
    """The training label: several GPUs beat one by at least :data:`PAYOFF`."""
    return multi < (1.0 - PAYOFF) * single


def fit_svm(X: np.ndarray, y: np.ndarray, C: float = 10.0, meta: dict | None = None) -> MaestroSVM:
    """Fit scikit-learn's RBF ``SVC`` (with a standard scaler) and return it as
    a :class:`MaestroSVM`; its decision function equals ``SVC.decision_function``."""
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=bool)
    if X.ndim != 2 or X.shape[1] != len(FEATURES) or len(X) != len(y):
        raise ValueError(f"X must be (samples x {len(FEATURES)}) with one label each; got {X.shape}, {y.shape}")
    if y.all() or not y.any():
        raise PolicyError("Maestro training set has only one class (multi-GPU always or never pays off); "
                          "add graphs or machines that differ")
    scaler = StandardScaler().fit(X)
    clf = SVC(kernel="rbf", C=C, gamma="scale", class_weight="balanced").fit(scaler.transform(X), y)
    if not bool(clf.classes_[1]):  # SVC's positive decision is its second class
        raise PolicyError(f"unexpected SVC class order {clf.classes_!r}")
    return MaestroSVM(mean=np.array(scaler.mean_, dtype=float), scale=np.array(scaler.scale_, dtype=float),
                      support_vectors=clf.support_vectors_.copy(), dual_coef=clf.dual_coef_[0].copy(),
                      intercept=float(clf.intercept_[0]), gamma=float(clf._gamma),
                      meta={"C": C, "samples": int(len(y)), "positives": int(y.sum()), **(meta or {})})
