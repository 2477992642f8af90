"""Fitting the ``ort`` backend's runtime model on measured plans.

Like the PyTorch runtime's (``backends/runtime_fit.py``, whose plan set,
record store and metrics this reuses): ``opsched profile --backend ort``
measures a set of plans of the model (:func:`runtime_fit.make_plans`: one op
at a time with per-op thread variants, co-running orders, the heuristics,
mixed and random plans) on the real backend, stores them beside the profiles
(``<profiles>/runtime/<machine>/ort_<graph>.json``) and refits
:class:`~opsched.engine.models.ort_runtime.OrtRuntime` on every such record of the
machine (:func:`fit_ort_runtime`), saved as ``.../ort.json``.

Measurement (:func:`measure_plans`) runs in this process: ONNX Runtime keeps
no per-process state between plans that would bias the next one (each
session owns its thread pool), unlike OpenMP teams.  Every plan is compiled
first (sessions built), then timed in interleaved rounds: ``warmup`` untimed
runs and the median of ``reps`` timed runs per sample; a sample taken while
other processes used the cores is taken again at the end of its round (up to
a few times, after a pause) and the quietest kept.

The fit minimises the summed absolute log error of the simulated against the
measured wall times: the per-node and per-hand-off costs on a joint grid (they
trade off against each other), then coordinate search over every field's grid
(the simulator is piecewise in them; a grid is robust where gradients are not).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opsched.backends.runtime_fit import (
    GraphRef,
    RuntimeRun,
    load_runs,
    make_plans,
    runtime_path,
    save_record,
)
from opsched.engine.contracts import PerfModel
from opsched.engine.models.ort_runtime import OrtRuntime
from opsched.engine.models.runtime import PlanningModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.timing import ContentionMeter, settle, wait_quiet

#: Grids of the coordinate search (seconds unless said).  ``spin_s`` is not
#: fitted: pools spin only in single-session plans (``OrtBackend(spinning="auto")``),
#: where nothing else runs beside them.
GRIDS: dict[str, tuple[float, ...]] = {
    "insitu_factor": tuple(float(x) for x in np.round(np.arange(0.7, 1.61, 0.05), 3)),
    "op_overhead_s": (0.0, 0.5e-6, 1e-6, 2e-6, 3e-6, 5e-6, 8e-6, 12e-6, 20e-6, 30e-6, 45e-6),
    "handoff_s": (0.0, 5e-6, 10e-6, 20e-6, 30e-6, 45e-6, 60e-6, 80e-6, 120e-6, 160e-6, 240e-6, 360e-6),
    "corun_c0": (0.0, 0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.3, 0.4, 0.55, 0.7),
    "thread_switch_s": (0.0, 5e-6, 10e-6, 20e-6, 40e-6, 80e-6, 160e-6),
}
#: The joint first search over the per-node and per-hand-off costs (coarser).
JOINT = {"op_overhead_s": (0.0, 1e-6, 2e-6, 4e-6, 8e-6, 16e-6, 32e-6),
         "handoff_s": (0.0, 10e-6, 20e-6, 40e-6, 80e-6, 160e-6, 320e-6)}
#: A sample is quiet when other processes used at most this many cores during it.
QUIET_CORES = 0.3


def measure_plans(graph: OpGraph, plans: Mapping[str, Plan], machine: Machine, model: PerfModel, *,
                  rounds: int = 3, warmup: int = 1, reps: int = 3, budget_s: float = 120.0,
                  max_tries: int = 5, settle_s: float = 0.5, quiet_wait_s: float = 30.0,
                  on_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Wall seconds of every plan on the ``ort`` backend (lowered with ``model``):
    per plan one sample per round (the median of ``reps`` runs), the sum of its
    ops' apportioned times, and the load of each sample.  A sample taken while
    other processes used the cores is taken again at the end of its round, once
    they leave them (waiting up to ``quiet_wait_s``), up to ``max_tries`` in all
    while within ``budget_s``; the quietest is kept, and a plan with quiet
    samples keeps only those.  Each sample starts once the last one's threads went
    quiet (:func:`opsched.timing.settle`: an ONNX Runtime session keeps its intra-op
    threads spinning for tens of milliseconds after a run)."""
    from opsched.backends.ort_backend import OrtBackend

    names = list(plans)
    out: dict[str, Any] = {"walls": {p: [] for p in names}, "busy": {p: [] for p in names},
                           "others": {p: [] for p in names}}
    t_start = time.perf_counter()
    with OrtBackend(machine, model=model, cache_size=len(names) + 1) as be:
        for p in names:
            be.compile(graph, plans[p])

        def sample(p: str) -> tuple[float, float, float]:
            settle()  # the last plan's intra-op pool may still spin: let it stop first
            for _ in range(warmup):
                be.run(graph, plans[p])
            with ContentionMeter() as meter:
                traces = [be.run(graph, plans[p]) for _ in range(reps)]
            walls = [t.meta["wall_s"] for t in traces]
            busy = [sum(e.end - e.start for e in t.events) for t in traces]
            return float(np.median(walls)), float(np.median(busy)), meter.others_cores

        done = 0
        for r in range(rounds):
            shift = (r * len(names)) // max(1, rounds)
            order = names[shift:] + names[:shift]
            again = []
            for p in order:
                got = sample(p)
                if got[2] > QUIET_CORES:
                    again.append((p, got))
                    continue
                _keep(out, p, got)
            for p, best in again:  # taken again, once the other processes leave the cores
                for _ in range(max_tries - 1):
                    if time.perf_counter() - t_start > budget_s:
                        break
                    wait_quiet(min(quiet_wait_s, max(0.0, budget_s - (time.perf_counter() - t_start))),
                               QUIET_CORES, window_s=settle_s)
                    got = sample(p)
                    best = got if got[2] < best[2] else best
                    if best[2] <= QUIET_CORES:
                        break
                _keep(out, p, best)
            done += 1
            if on_round is not None:
                on_round(done)
            if done >= 2 and time.perf_counter() - t_start > budget_s:
                break
    out["rounds"] = done
    for p in names:  # plans with quiet samples keep only those
        quiet = [k for k, o in enumerate(out["others"][p]) if o <= QUIET_CORES]
        if quiet and len(quiet) < len(out["others"][p]):
            for key in ("walls", "busy", "others"):
                out[key][p] = [out[key][p][k] for k in quiet]
    return out


def _keep(out: dict[str, Any], p: str, got: tuple[float, float, float]) -> None:
    out["walls"][p].append(got[0])
    out["busy"][p].append(got[1])
    out["others"][p].append(got[2])


def wall_time(graph: OpGraph, machine: Machine, model: PerfModel, plan: Plan) -> float:
    """The simulated wall time of ``plan`` (validated) under ``model``: the makespan, plus
    waking the calling thread at the end when the model follows the runtime's threads."""
    from opsched.engine.sim import prepare, replay

    st, _ = replay(prepare(graph, machine, model), plan)
    return float(st.makespan + st.wake_end)


def fit_ort_runtime(runs: Sequence[RuntimeRun], machine: Machine, perf: PerfModel, sweeps: int = 2,
                    grids: Mapping[str, Sequence[float]] | None = None, start: OrtRuntime | None = None,
                    joint: bool = True) -> OrtRuntime:
    """The :class:`OrtRuntime` whose simulations best match the measured plans of ``runs``
    (from ``start``, by default the neutral model; ``joint``: search the per-node and
    per-hand-off costs jointly first).  Plans with no sample taken while the machine
    was quiet (:data:`QUIET_CORES`) are left out."""
    grids = dict(GRIDS if grids is None else grids)
    fitted_on = tuple(r.name for r in runs)
    cur = {k: float(getattr(start, k)) if start is not None else OrtRuntime._DEFAULTS.get(k, 0.0)
           for k in OrtRuntime._FIELDS}
    # plans measured only while other processes used the cores say more about them than about the runtime
    real = [[(p, r.measured(p)) for p in r.plans if min(r.others[p], default=0.0) <= QUIET_CORES] for r in runs]
    if not any(real):
        return OrtRuntime(**cur, fitted_on=fitted_on)

    def err(vals: Mapping[str, float]) -> float:
        model = PlanningModel(perf, OrtRuntime(**vals, fitted_on=()))
        return sum(abs(float(np.log(wall_time(r.graph, machine, model, r.plans[p]) / m)))
                   for r, ms in zip(runs, real, strict=True) for p, m in ms)

    best = err(cur)
    if joint:  # the per-node and per-hand-off costs trade off against each other
        for o in JOINT["op_overhead_s"]:
            for h in JOINT["handoff_s"]:
                trial = {**cur, "op_overhead_s": float(o), "handoff_s": float(h)}
                e = err(trial)
                if e < best - 1e-9:
                    best, cur = e, trial
    for _ in range(max(sweeps, 1) * 3):  # sweeps until nothing moves, at most three times ``sweeps``
        moved = False
        for field in OrtRuntime._FIELDS:
            for x in grids.get(field, ()):
                if x == cur[field]:
                    continue
                trial = {**cur, field: float(x)}
                e = err(trial)
                if e < best - 1e-9:
                    best, cur, moved = e, trial, True
        for trial in _pair_moves(cur, grids, "op_overhead_s", "handoff_s"):  # one moves, the other makes up
            e = err(trial)
            if e < best - 1e-9:
                best, cur, moved = e, trial, True
        if not moved:
            break
    return OrtRuntime(**cur, fitted_on=fitted_on)


def _pair_moves(cur: Mapping[str, float], grids: Mapping[str, Sequence[float]], a: str, b: str
                ) -> list[dict[str, float]]:
    """``cur`` with ``a`` and ``b`` both moved one grid step (the coupled directions a
    coordinate search cannot take)."""
    ga, gb = list(grids.get(a, ())), list(grids.get(b, ()))
    if not ga or not gb:
        return []
    ia = int(np.argmin([abs(x - cur[a]) for x in ga]))
    ib = int(np.argmin([abs(x - cur[b]) for x in gb]))
    out = []
    for da in (-1, 1):
        for db in (-1, 1):
            ja, jb = ia + da, ib + db
            if 0 <= ja < len(ga) and 0 <= jb < len(gb):
                out.append({**cur, a: float(ga[ja]), b: float(gb[jb])})
    return out


def ort_plans(graph: OpGraph, machine: Machine, model: PerfModel, n_plans: int = 16, seed: int = 0
              ) -> dict[str, Plan]:
    """The plans measured for the runtime model: :func:`runtime_fit.make_plans` plus
    the single-session plan."""
    from opsched.backends.ort_lower import single_session_plan

    plans = make_plans(graph, machine, model, n_plans, seed)
    single = single_session_plan(graph, machine)
    if all(p.assignments != single.assignments for p in plans.values()):
        plans["ort-single"] = single
    return plans


def calibrate_ort(graph: OpGraph, ref: GraphRef, machine: Machine, perf: PerfModel, *, n_plans: int = 16,
                  rounds: int = 3, warmup: int = 1, reps: int = 3, budget_s: float = 300.0,
                  cache_dir: str | Path | None = None, on_round: Callable[[int], None] | None = None
                  ) -> tuple[OrtRuntime, list[RuntimeRun]]:
    """Measure plans of ``graph`` on the ``ort`` backend, store them, refit the
    runtime model on every stored ``ort`` record of ``machine`` and save it."""
    from opsched.backends.runtime_fit import load_runtime

    old = load_runtime(machine, "ort", cache_dir)
    assert old is None or isinstance(old, OrtRuntime)  # the registry's runtime model class of "ort"
    lowering_model = PlanningModel(perf, old) if old is not None else perf
    plans = ort_plans(graph, machine, perf, n_plans)
    t0, load0 = time.time(), os.getloadavg()
    meas = measure_plans(graph, plans, machine, lowering_model, rounds=rounds, warmup=warmup, reps=reps,
                         budget_s=budget_s, on_round=on_round)
    import onnxruntime as ort

    save_record(graph, ref, machine, plans, {k: meas[k] for k in ("walls", "busy", "others")}, {
        "rounds": meas["rounds"], "warmup": warmup, "reps": reps, "seconds": round(time.time() - t0, 2),
        "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()), "onnxruntime": ort.__version__},
        backend="ort", cache_dir=cache_dir)
    runs = load_runs(machine, perf, backend="ort", cache_dir=cache_dir)
    # from the last fit: one coordinate search, no joint grid (the records only grew)
    model = fit_ort_runtime(runs, machine, perf, start=old, sweeps=1, joint=old is None)
    model.save(runtime_path(machine, "ort", cache_dir))
    return model, runs


__all__ = ["GRIDS", "JOINT", "QUIET_CORES", "calibrate_ort", "fit_ort_runtime", "measure_plans", "ort_plans", "wall_time"]
