"""What a user plans with: the performance model, the backend's runtime model, the policy.

One place decides the planning model for every command and benchmark
(:func:`planning_model`): on a real backend, the model fitted to this
machine's cached profiles joined to the backend's runtime model fitted by
``opsched profile`` (:class:`~opsched.engine.models.runtime.PlanningModel`); the
analytic model when nothing is cached or on the simulator's presets.  A
profile measured while other processes used the cores is not used: it is
skipped with a :class:`LoadWarning` naming it (profile again on a quieter
machine).  Plans are cached per (policy, graph, machine, model)
(:func:`plan_cached`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsched.engine.contracts import PerfModel
from opsched.errors import OpschedError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU
from opsched.machine import Machine
from opsched.plan import Plan

if TYPE_CHECKING:
    from opsched.policies import Policy

#: ``--perf-model`` choices.
PERF_MODELS = ("auto", "analytic", "fitted")
#: A profile whose ops were measured while other processes used more than this
#: many cores (median over ops) is not planned with.
LOADED_PROFILE_CORES = 0.25


class LoadWarning(UserWarning):
    """A measurement was taken while other processes used the cores (the message says which)."""


def default_cache_dir() -> Path:
    """The profile folder planning reads by default (:func:`opsched.cache.profiles_dir`)."""
    from opsched.cache import profiles_dir

    return profiles_dir()


def quiet_profiles(machine: Machine, cache_dir: str | Path | None = None) -> list[Any]:
    """The cached profiles of this machine's CPU, without those measured under
    load (each skipped one is named in a :class:`LoadWarning`)."""
    import statistics

    from opsched.engine.profiles import load_profiles

    out = []
    for prof in load_profiles(None, cache_dir or default_cache_dir()):
        if not prof.matches_device(machine.cpu):
            continue
        others = statistics.median(o.others_cores for o in prof.ops.values()) if prof.ops else 0.0
        if others > LOADED_PROFILE_CORES:
            warnings.warn(f"not planning with the profile of {prof.graph_name!r}: other processes used "
                          f"{others:.2f} cores (median over its ops) while it was measured; run `opsched "
                          f"profile ... --refresh` on a quieter machine", LoadWarning, stacklevel=3)
            continue
        out.append(prof)
    return out


def planning_model(machine: Machine, backend: str = "torch-cpu", choice: str = "auto",
                   cache_dir: str | Path | None = None) -> PerfModel:
    """The model plans for ``backend`` on ``machine`` are made with.

    ``choice``: ``analytic``; ``fitted`` (this machine's profiles, which must
    exist, plus the backend's runtime model when ``opsched profile`` fitted
    one); ``auto`` (``fitted`` when there are profiles and the backend is
    real, else ``analytic`` - so the simulator's preset figures do not depend
    on what happens to be cached)."""
    from opsched.backends.registry import ORT_PROFILES, spec
    from opsched.engine.models.analytic import AnalyticModel

    if choice not in PERF_MODELS:
        raise OpschedError(f"--perf-model must be one of {', '.join(PERF_MODELS)}, got {choice!r}")
    be = spec(backend)
    if choice == "analytic" or (choice == "auto" and not be.real) or be.profiles is None:
        return AnalyticModel()
    from opsched.backends.runtime_fit import load_runtime
    from opsched.engine.models.fitted import FittedModel
    from opsched.engine.models.runtime import PlanningModel

    cache = cache_dir or default_cache_dir()
    if be.profiles == ORT_PROFILES:  # ONNX Runtime's kernel profiles live apart from PyTorch's op profiles
        from opsched.backends.ort_profiler import ort_cache_dir

        profiles = quiet_profiles(machine, ort_cache_dir(cache))
    else:
        profiles = quiet_profiles(machine, cache)
    if not profiles:
        if choice == "fitted":
            how = f" --backend {backend}" if be.profiles == ORT_PROFILES else ""
            raise OpschedError(f"--perf-model fitted: no usable profiles of this machine ({machine.fingerprint()}) "
                               f"in {cache}; run `opsched profile zoo:resnet50{how}` (or your model) first")
        return AnalyticModel()
    fitted = FittedModel(profiles)
    runtime = load_runtime(machine, backend, cache) if be.runtime_model else None
    return PlanningModel(fitted, runtime) if runtime is not None else fitted


def describe(model: PerfModel) -> str:
    """The planning model in a few words, for tables and run records."""
    words = {"analytic": "analytic (no usable profile)", "fitted": "fitted (cached profiles)"}
    if model.runtime is not None:
        return f"fitted (cached profiles) + {model.runtime.backend} runtime model"
    return words.get(model.name, model.name)


def resolve_policy(policy: Policy | str | Path | None) -> Policy:
    """A Policy as is; ``None`` the shipped pretrained policy; a Path an exported
    policy folder; a string a registered name (``"critical-path-first"``) or an
    exported policy's path."""
    from opsched.policies import Policy, get_policy, load
    from opsched.policies.exported import pretrained_path

    if policy is None:
        return load(pretrained_path())
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Path):
        return load(policy)
    return get_policy(str(policy))


def policy_key(policy: Policy) -> str:
    """What identifies a policy's decisions in the plan cache."""
    digest = getattr(policy, "digest", None)
    return f"{policy.name}:{digest}" if digest else policy.name


_PLANS = IdentityLRU(64)


def plan_cached(policy: Policy, graph: OpGraph, machine: Machine, model: PerfModel | None = None) -> Plan:
    """``policy.plan(graph, machine, model)``, cached by policy, graph and
    machine fingerprint and the model's name."""
    found = candidates_cached(policy, graph, machine, model)
    if found is not None:
        from opsched.policies.exported import pick

        return pick(found)
    return _PLANS.get_or_make(("plan", *_key(policy, graph, machine, model)), lambda: policy.plan(graph, machine, model))


def candidates_cached(policy: Policy, graph: OpGraph, machine: Machine,
                      model: PerfModel | None = None) -> dict[str, tuple[Plan, float]] | None:
    """``policy.plan_candidates(graph, machine, model)`` (every plan the learned
    policy chose among, with its predicted makespan), cached like
    :func:`plan_cached`; None for a policy that plans one way only (a heuristic)."""
    plan_candidates = getattr(policy, "plan_candidates", None)  # the exported learned policy's
    if plan_candidates is None:
        return None
    return _PLANS.get_or_make(("candidates", *_key(policy, graph, machine, model)),
                              lambda: plan_candidates(graph, machine, model))


def _key(policy: Policy, graph: OpGraph, machine: Machine, model: PerfModel | None) -> tuple:
    return (policy_key(policy), graph.fingerprint(), machine.fingerprint(), getattr(model, "name", None))


__all__ = ["PERF_MODELS", "LoadWarning", "candidates_cached", "describe", "plan_cached", "planning_model", "policy_key",
           "quiet_profiles", "resolve_policy"]
