"""Validation: the learned policy against the heuristic baselines.

For every (validation graph, validation machine) pair the policy schedules one
episode greedily (masked argmax; its hint prior at the exported scheduler's
plan-time ``prior_scale``, so the best model is chosen on the greedy decoding
that ships -- :func:`opsched.agents.policy.hint_prior_scaled`), the episode's Plan is replayed on the
simulator, and its makespan is divided by each baseline's (the baseline's
Plan on the same simulator): like for like, ratio < 1 means the learned
policy is faster.  Ratios are summarised by their mean and geometric mean per
baseline, and against ``best`` -- per pair, the fastest of the baselines
other than ``sequential`` would be redundant, so simply the fastest of all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opsched.agents.config import TrainConfig
from opsched.specs import load_graph, load_machine


@dataclass
class Pair:
    """One (graph, machine) evaluation case with its baselines' makespans."""

    graph_spec: str
    machine_spec: str
    graph: Any
    machine: Any
    baselines: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.graph_spec}@{self.machine_spec}"

    @property
    def best_baseline(self) -> float:
        return min(self.baselines.values())


@dataclass
class EvalResult:
    """Makespans of one evaluation and their ratios to the baselines."""

    makespans: dict[str, float]                 # pair label -> learned makespan
    ratios: dict[str, dict[str, float]]         # baseline (and "best") -> pair label -> ratio
    returns: dict[str, float]                   # pair label -> episode return

    def gmean(self, baseline: str) -> float:
        vals = list(self.ratios[baseline].values())
        return float(math.exp(sum(math.log(v) for v in vals) / len(vals)))

    def mean(self, baseline: str) -> float:
        vals = list(self.ratios[baseline].values())
        return float(sum(vals) / len(vals))

    def worst(self, baseline: str) -> float:
        return float(max(self.ratios[baseline].values()))

    def row(self) -> dict[str, float]:
        """The flat figures logged to TensorBoard and ``evaluations.csv``."""
        out: dict[str, float] = {}
        for b in self.ratios:
            key = _short(b)
            out[f"gmean_{key}"] = self.gmean(b)
            out[f"mean_{key}"] = self.mean(b)
            out[f"worst_{key}"] = self.worst(b)
        out["mean_return"] = float(np.mean(list(self.returns.values())))
        return out


def _short(name: str) -> str:
    return {"critical-path-first": "cpf"}.get(name, name.replace("-", "_"))


def build_pairs(graph_specs: Sequence[str], machine_specs: Sequence[str], cache_dir: Any = None) -> list[Pair]:
    graphs = {g: load_graph(g, cache_dir=cache_dir) for g in graph_specs}
    machines = {m: load_machine(m) for m in machine_specs}
    return [Pair(g, m, graphs[g], machines[m]) for g in graph_specs for m in machine_specs]


def baseline_makespans(pairs: Sequence[Pair], baselines: Sequence[str], model: Any = None) -> None:
    """Fill each pair's ``baselines`` with the simulated makespan of each heuristic's Plan."""
    from opsched.backends.sim import SimBackend
    from opsched.policies import get_policy

    for p in pairs:
        sim = SimBackend(p.machine, model=model)
        for name in baselines:
            plan = get_policy(name).plan(p.graph, p.machine, model)
            p.baselines[name] = sim.makespan(p.graph, plan)


class ValidationEvaluator:
    """Runs the policy greedily on every validation pair and compares with the baselines."""

    def __init__(self, config: TrainConfig, model: Any = None, cache_dir: Any = None,
                 known: Sequence[dict[str, Any]] | None = None, prior_scale: float | None = None) -> None:
        """``known``: rows of a run's ``validation_baselines.json`` (a resumed run
        reads its baselines' makespans instead of planning them again); used
        only when they cover exactly these pairs and baselines.  ``prior_scale``:
        the hint prior's multiplier while a policy is scored
        (:func:`opsched.agents.policy.hint_prior_scaled`); default the exported
        scheduler's plan-time setting, so the best model is chosen on the
        greedy decoding that ships."""
        from opsched.agents.environments import make_env
        from opsched.policies.exported import DEFAULT_PLANNING

        self.prior_scale = float(DEFAULT_PLANNING["prior_scale"] if prior_scale is None else prior_scale)

        self.pairs = build_pairs(config.validation_graphs, config.validation_machines, cache_dir)
        if not _fill_known(self.pairs, config.baselines, known):
            baseline_makespans(self.pairs, config.baselines, model)
        self.model = model
        self.envs = [make_env([p.graph], [p.machine], config.max_nodes, model=model,
                              hint_plan=getattr(config, "hint_observation", True)) for p in self.pairs]

    def evaluate(self, act: Callable[[dict, np.ndarray], int],
                 should_stop: Callable[[], bool] = lambda: False) -> EvalResult | None:
        """``act(obs, mask) -> action`` for every decision; None if ``should_stop`` fired."""
        from opsched.backends.sim import SimBackend

        makespans, returns = {}, {}
        for pair, env in zip(self.pairs, self.envs):
            episode = run_episode(env, act, should_stop)
            if episode is None:
                return None
            ret, info = episode
            # the plan an export of this policy would make: the hint followed member by member
            trace = SimBackend(pair.machine, model=self.model).run(pair.graph, info["plan_followed"])
            makespans[pair.label] = float(trace.makespan)
            returns[pair.label] = ret
        ratios: dict[str, dict[str, float]] = {}
        for name in self.pairs[0].baselines:
            ratios[name] = {p.label: makespans[p.label] / p.baselines[name] for p in self.pairs}
        ratios["best"] = {p.label: makespans[p.label] / p.best_baseline for p in self.pairs}
        return EvalResult(makespans, ratios, returns)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _fill_known(pairs: Sequence[Pair], baselines: Sequence[str], known: Sequence[dict[str, Any]] | None) -> bool:
    if not known or len(known) != len(pairs):
        return False
    for p, row in zip(pairs, known):
        if row.get("graph") != p.graph_spec or row.get("machine") != p.machine_spec:
            return False
        if not all(isinstance(row.get(b), (int, float)) and row[b] > 0 for b in baselines):
            return False
    for p, row in zip(pairs, known):
        p.baselines = {b: float(row[b]) for b in baselines}
    return True


def run_episode(env: Any, act: Callable[[dict, np.ndarray], int],
                should_stop: Callable[[], bool] = lambda: False, seed: int = 0,
                options: dict | None = None) -> tuple[float, dict] | None:
    """One episode with ``act``: (return, final info), or None if ``should_stop`` fired."""
    obs, _ = env.reset(seed=seed, options=options)
    total = 0.0
    while True:
        if should_stop():
            return None
        action = act(obs, env.action_masks())
        obs, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        if terminated or truncated:
            return total, info


def policy_actor(policy: Any) -> Callable[[dict, np.ndarray], int]:
    """``act(obs, mask)`` for an SB3 MaskablePPO policy, greedy (deterministic)."""

    def act(obs: dict, mask: np.ndarray) -> int:
        action, _ = policy.predict(obs, action_masks=mask, deterministic=True)
        return int(action)

    return act


def real_comparison(policies: dict[str, Any], graphs: dict[str, Any], machine: Any, max_nodes: int,
                    backend: str = "torch-cpu", baseline: str = "critical-path-first",
                    repeats: int = 3) -> list[dict[str, Any]]:
    """Measured makespans (median of ``repeats`` after a warm-up) of each policy's
    greedy plan and of ``baseline``'s plan, per graph, on the real backend.

    This is how much real fine-tuning changed real makespans: ``policies`` holds
    the model it started from and the one it ended with."""
    import statistics

    from opsched.agents.environments import make_env
    from opsched.backends.registry import get_backend
    from opsched.policies import get_policy

    env = make_env(list(graphs.values()), [machine], max_nodes, backend=backend)
    rows = []
    try:
        for spec, graph in graphs.items():
            row: dict[str, Any] = {"graph": spec, "machine": machine.name}
            for name, policy in policies.items():
                played = run_episode(env, policy_actor(policy), options={"graph": graph, "machine": machine})
                assert played is not None  # None only when its should_stop fires (there is none here)
                row[name] = float(played[1]["measured_makespan"])
            with get_backend(backend, machine) as real:
                plan = get_policy(baseline).plan(graph, machine)
                real.run(graph, plan)
                row[baseline] = float(statistics.median(real.run(graph, plan).makespan for _ in range(repeats)))
            rows.append(row)
    finally:
        env.close()
    return rows
