"""Black-box search over one graph's plan with Optuna (ask/tell).

What search buys without learning: for a fixed graph and machine, try
``n_trials`` plans -- per op a device, a thread level of that device and a
priority -- each evaluated by the simulator under the given performance model,
and keep the fastest.  The loop uses Optuna's ask/tell interface, so the same
loop could be driven by real measurements; the study is in memory unless a
``storage`` URL (``sqlite:///study.db``, a database server) is given, in which
case it is resumable and shareable.  The first trial is Graphi's
critical-path-first plan (``warm_start``), so search starts from a strong
heuristic rather than from noise.  It is the reference the learned policy
should approach in a fraction of the time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opsched.engine.contracts import PerfModel
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan
from opsched.policies.base import Policy, build_plan, resolve_model
from opsched.policies.registry import register

SAMPLERS = ("local", "tpe", "random")


def _local_sampler_class() -> type:
    """Optuna's samplers model each parameter on its own (TPE) or not at all
    (random); with three parameters per op, a few hundred of them, neither
    finds its way from a good plan to a better one in a few hundred trials.
    This sampler is a (1+1) evolution strategy in Optuna's sampler interface:
    each trial copies the best trial so far and mutates about two parameters
    (a new device or thread level, or a priority nudged by N(0, 0.15)), so
    the search walks from the warm start to better plans."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    class LocalSearchSampler(optuna.samplers.BaseSampler):
        def __init__(self, seed: int = 0, mutations: float = 2.0) -> None:
            self._rng = np.random.default_rng(seed)
            self._random = optuna.samplers.RandomSampler(seed=seed)
            self._mutations = mutations
            self._best: tuple[int, dict[str, Any]] = (-1, {})

        def infer_relative_search_space(self, study: Any, trial: Any) -> dict:
            return {}

        def sample_relative(self, study: Any, trial: Any, search_space: dict) -> dict:
            return {}

        def _best_params(self, study: Any, number: int) -> dict[str, Any]:
            if self._best[0] != number:
                try:
                    params = study.best_trial.params
                except ValueError:  # no finished trial yet
                    params = {}
                self._best = (number, params)
            return self._best[1]

        def sample_independent(self, study: Any, trial: Any, name: str, dist: Any) -> Any:
            best = self._best_params(study, trial.number)
            if name not in best:
                return self._random.sample_independent(study, trial, name, dist)
            rate = min(1.0, self._mutations / max(1, len(best)))
            if self._rng.random() >= rate:
                return best[name]
            if isinstance(dist, FloatDistribution):
                return float(np.clip(best[name] + self._rng.normal(0.0, 0.15), dist.low, dist.high))
            if isinstance(dist, CategoricalDistribution):
                return dist.choices[int(self._rng.integers(len(dist.choices)))]
            return self._random.sample_independent(study, trial, name, dist)

    return LocalSearchSampler


@register("search", roles=(), order=50)
class OptunaSearch(Policy):
    """Optuna search over per-op device, thread level and priority."""

    name = "search"

    def __init__(self, n_trials: int = 100, seed: int = 0, storage: str | None = None,
                 study_name: str | None = None, sampler: str = "local", warm_start: bool = True) -> None:
        if n_trials < 1:
            raise ValueError(f"n_trials must be >= 1, got {n_trials}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self.n_trials = n_trials
        self.seed = seed
        self.storage = storage
        self.study_name = study_name
        self.sampler = sampler
        self.warm_start = warm_start

    def plan(self, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
        import optuna

        from opsched.engine.sim import Simulator

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        model = resolve_model(model)
        sim = Simulator(machine, model=model)
        sampler = {
            "tpe": lambda: optuna.samplers.TPESampler(seed=self.seed),
            "random": lambda: optuna.samplers.RandomSampler(seed=self.seed),
            "local": lambda: _local_sampler_class()(seed=self.seed),
        }[self.sampler]()
        name = self.study_name or f"opsched-search-{graph.fingerprint()}-{machine.fingerprint()}"
        study = optuna.create_study(direction="minimize", sampler=sampler, storage=self.storage,
                                    study_name=name, load_if_exists=self.storage is not None)
        if self.warm_start and not study.trials:
            from opsched.policies.cpf import CriticalPathFirst

            study.enqueue_trial(self.params_of(CriticalPathFirst().plan(graph, machine, model), graph, machine))
        for _ in range(self.n_trials):
            trial = study.ask()
            plan = self.decode(trial, graph, machine)
            study.tell(trial, sim.makespan(graph, plan))
        best = study.best_trial
        plan = self.decode(optuna.trial.FixedTrial(best.params), graph, machine)
        return build_plan(graph, machine, plan.assignments, policy=self.name, n_trials=len(study.trials),
                          best_trial=best.number, predicted_makespan=best.value, seed=self.seed,
                          first_makespan=study.trials[0].value)

    @staticmethod
    def decode(trial: Any, graph: OpGraph, machine: Machine) -> Plan:
        """The plan a trial's suggestions describe (one device, thread level and
        priority per op; a parameter with one possible value is not searched)."""
        devices = [d.id for d in machine.devices]
        assignments = {}
        for i, op in enumerate(graph.ops):
            dev_id = trial.suggest_categorical(f"dev{i}", devices) if len(devices) > 1 else devices[0]
            levels = list(machine.device(dev_id).thread_levels())
            threads = trial.suggest_categorical(f"thr{i}:{dev_id}", levels) if len(levels) > 1 else levels[0]
            priority = trial.suggest_float(f"pri{i}", 0.0, 1.0)
            assignments[op.id] = Assignment(dev_id, int(threads), priority)
        return build_plan(graph, machine, assignments, policy="search")

    @staticmethod
    def params_of(plan: Plan, graph: OpGraph, machine: Machine) -> dict[str, Any]:
        """Trial parameters that reproduce ``plan``'s devices, threads and priority
        order (``after`` lists cannot be expressed and are dropped)."""
        prios = [plan[op.id].priority for op in graph.ops]
        lo, hi = min(prios, default=0.0), max(prios, default=1.0)
        span = hi - lo if hi > lo else 1.0
        params: dict[str, Any] = {}
        for i, op in enumerate(graph.ops):
            a = plan[op.id]
            if len(machine.devices) > 1:
                params[f"dev{i}"] = a.device
            if len(machine.device(a.device).thread_levels()) > 1:
                params[f"thr{i}:{a.device}"] = a.threads
            params[f"pri{i}"] = (a.priority - lo) / span
        return params
