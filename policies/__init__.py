"""Schedulers: every decision-maker is a policy, and every policy produces a Plan.

A policy is an object with a ``name`` and ``plan(graph, machine, model=None)
-> Plan`` (:class:`~opsched.policies.base.Policy`).  The registry here names
the heuristic baselines, the Optuna search and -- through :func:`load` -- the
exported learned policy, so ``opsched compare`` and the Python API pick any of
them the same way::

    from opsched.policies import get_policy
    plan = get_policy("critical-path-first").plan(graph, machine)

``"all"`` expands to every heuristic (:data:`HEURISTICS`) and ``learned``, the
policy shipped with opsched; ``search`` and ``cpsat`` are left out of ``all``
because they spend a budget (simulations, CP-SAT seconds) per graph.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from opsched.errors import PolicyError
from opsched.policies.base import Policy, timed_plan

#: name -> "module:Class", imported on first use.
POLICIES: dict[str, str] = {
    "sequential": "opsched.policies.heuristics:Sequential",
    "tf-default": "opsched.policies.heuristics:TFDefault",
    "tf-recommended": "opsched.policies.heuristics:TFRecommended",
    "critical-path-first": "opsched.policies.cpf:CriticalPathFirst",
    "heft": "opsched.policies.heft:HeftPolicy",
    "maestro": "opsched.policies.maestro:Maestro",
    "random": "opsched.policies.heuristics:RandomPolicy",
    "search": "opsched.policies.search:OptunaSearch",
    # moldable-task scheduling (issue 23)
    "cpa": "opsched.policies.cpa:CPA",
    "bicpa": "opsched.policies.bicpa:BiCPA",
    "lp-rounding": "opsched.policies.lp_rounding:LPRounding",
    "cpsat": "opsched.policies.cpsat:CpSat",
}
#: What ``"all"`` means: every heuristic baseline, sequential first (the reference).
HEURISTICS: tuple[str, ...] = (
    "sequential", "tf-default", "tf-recommended", "critical-path-first", "heft", "maestro", "random",
    "cpa", "bicpa", "lp-rounding",
)
ALIASES: dict[str, str] = {"cpf": "critical-path-first", "graphi": "critical-path-first", "eager": "sequential",
                           "pretrained": "learned"}
#: The name of the exported policy shipped with opsched (``policies/pretrained``).
LEARNED = "learned"


def get_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (keyword arguments go to its constructor), or
    an exported learned policy when ``name`` is a path that exists."""
    key = ALIASES.get(name, name)
    if key == LEARNED:
        from opsched.policies.exported import pretrained_path

        return load(pretrained_path())
    if key not in POLICIES:
        if name and Path(name).exists():
            return load(name)
        raise PolicyError(
            f"unknown policy {name!r}; choose from {', '.join(POLICIES)}, {LEARNED}, 'all', "
            "or the path of an exported policy"
        )
    module, _, cls = POLICIES[key].partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def expand_names(spec: str) -> list[str]:
    """``"all,search"`` -> the heuristic names then ``search`` (duplicates dropped)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        for name in (*HEURISTICS, LEARNED) if part == "all" else (ALIASES.get(part, part),):
            if name not in out:
                out.append(name)
    if not out:
        raise PolicyError(f"no policy named in {spec!r}")
    return out


def get_policies(spec: str, **kwargs_by_name: dict[str, Any]) -> list[Policy]:
    """Policies for a comma-separated spec; ``kwargs_by_name[name]`` are passed
    to that policy's constructor."""
    return [get_policy(n, **kwargs_by_name.get(n, {})) for n in expand_names(spec)]


def load(path: str | Path) -> Policy:
    """Load an exported learned policy (numpy only; nothing in the file runs)."""
    try:
        from opsched.policies.exported import load as _load
    except ImportError as exc:
        raise PolicyError(f"{path}: cannot load exported policies in this install ({exc})") from None
    return _load(path)


__all__ = ["HEURISTICS", "POLICIES", "Policy", "expand_names", "get_policies", "get_policy", "load",
           "timed_plan"]
