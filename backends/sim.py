"""The simulator as a backend: :class:`SimBackend` replays a Plan in the engine's
discrete-event simulator (:mod:`opsched.engine.sim`) and returns its Trace."""

from __future__ import annotations

import math

import numpy as np

from opsched.backends.base import BackendBase
from opsched.engine.contracts import PerfModel
from opsched.engine.sim import SimStatic, cached_fingerprint, default_perf_model, prepare, replay
from opsched.errors import PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace


class SimBackend(BackendBase):
    """Discrete-event execution of a Plan with a performance model.

    ``model`` defaults to the analytic model; a :class:`~opsched.backends.runtime.PlanningModel`
    also prices what its real runtime adds (hand-offs, OpenMP spin and teams).
    ``noise`` is the sigma of a lognormal factor on every op's time (0: none),
    drawn from ``numpy.random.default_rng(seed)`` -- a backend built with the
    same seed reproduces the same sequence of runs; ``run(..., seed=s)``
    reproduces one run.
    """

    name = "sim"
    measured = False

    def __init__(self, machine: Machine, model: PerfModel | None = None, noise: float = 0.0, seed: int = 0) -> None:
        super().__init__(machine)
        if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
            raise ValueError(f"SimBackend: noise must be a finite number >= 0, got {noise!r}")
        self.model = default_perf_model() if model is None else model
        self.noise = float(noise)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def static(self, graph: OpGraph) -> SimStatic:
        return prepare(graph, self.machine, self.model)

    def validate(self, graph: OpGraph, plan: Plan) -> None:
        """Plan.validate, with the fingerprints compared through a per-object cache."""
        where = f"plan{' ' + repr(plan.policy) if plan.policy else ''} for graph {graph.name!r}"
        if plan.graph_fingerprint and plan.graph_fingerprint != cached_fingerprint(graph):
            raise PlanError(f"{where}: made for a different graph (fingerprint {plan.graph_fingerprint}, "
                            f"this graph is {cached_fingerprint(graph)})")
        if plan.machine_fingerprint and plan.machine_fingerprint != cached_fingerprint(self.machine):
            raise PlanError(f"{where}: made for a different machine (fingerprint {plan.machine_fingerprint}, "
                            f"machine {self.machine.name!r} is {cached_fingerprint(self.machine)})")
        plan.validate(graph, self.machine, check_fingerprints=False)

    def run(self, graph: OpGraph, plan: Plan, inputs: object = None, seed: int | None = None) -> Trace:
        """Simulate ``plan`` (``inputs`` are ignored: the simulator computes no values)."""
        self.validate(graph, plan)
        s = self.static(graph)
        noise = None
        if self.noise > 0:
            rng = self._rng if seed is None else np.random.default_rng(seed)
            noise = rng.lognormal(0.0, self.noise, s.n).tolist()
        st, throttled = replay(s, plan, noise)
        meta = {"omp_throttled": True} if throttled else {}
        return st.trace("sim", model=self.model.name, noise=self.noise, policy=plan.policy, **meta)


__all__ = ["SimBackend"]
