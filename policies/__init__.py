"""Schedulers: every decision-maker is a policy, and every policy produces a Plan.

A policy is an object with a ``name`` and ``plan(graph, machine, model=None)
-> Plan`` (:class:`~opsched.policies.base.Policy`).  Heuristics register
themselves with their roles (:mod:`opsched.policies.registry`); the exported
learned policy is loaded from its folder (:func:`load`).  ``opsched compare``,
training, the benchmarks and the Python API pick any of them the same way::

    from opsched.policies import get_policy
    plan = get_policy("critical-path-first").plan(graph, machine)

``"all"`` expands to every baseline and control heuristic (sequential first)
and ``learned``, the policy shipped with opsched; policies without a role
(``search`` and ``cpsat``, which spend a budget of simulations or CP-SAT
seconds per graph, and the ONNX Runtime lane planner) are named explicitly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsched.errors import PolicyError
from opsched.policies.base import Policy, timed_plan
from opsched.policies.registry import (
    BASELINE,
    CONTROL,
    HINT,
    TEACHER,
    canonical,
    entries,
    entry,
    names,
    register,
)

if TYPE_CHECKING:  # imported when a policy is loaded (it needs only numpy, but is not small)
    from opsched.policies.exported import ExportedPolicy

#: The name of the exported policy shipped with opsched (``policies/pretrained``).
LEARNED = "learned"
_LEARNED_ALIASES = ("pretrained",)


def heuristic_names() -> tuple[str, ...]:
    """What ``all`` means without ``learned``: the baseline and control heuristics, in listing order."""
    return tuple(e.name for e in entries() if e.roles & {BASELINE, CONTROL})


def get_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (keyword arguments go to its constructor), or
    an exported learned policy when ``name`` is ``learned`` or a path that exists."""
    if name == LEARNED or name in _LEARNED_ALIASES:
        from opsched.policies.exported import pretrained_path

        return load(pretrained_path())
    try:
        found = entry(name)
    except PolicyError:
        if name and Path(name).exists():
            return load(name)
        raise PolicyError(f"unknown policy {name!r}; choose from {', '.join(names())}, {LEARNED}, 'all', "
                          "or the path of an exported policy") from None
    return found.make(**kwargs)


def expand_names(spec: str) -> list[str]:
    """``"all,search"`` -> the heuristic names then ``search`` (duplicates dropped)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part == "all":
            group: tuple[str, ...] = (*heuristic_names(), LEARNED)
        elif part in _LEARNED_ALIASES:
            group = (LEARNED,)
        else:
            group = (canonical(part),)
        for name in group:
            if name not in out:
                out.append(name)
    if not out:
        raise PolicyError(f"no policy named in {spec!r}")
    return out


def get_policies(spec: str, **kwargs_by_name: dict[str, Any]) -> list[Policy]:
    """Policies for a comma-separated spec; ``kwargs_by_name[name]`` are passed
    to that policy's constructor."""
    return [get_policy(n, **kwargs_by_name.get(n, {})) for n in expand_names(spec)]


def load(path: str | Path) -> ExportedPolicy:
    """Load an exported learned policy (numpy only; nothing in the file runs)."""
    try:
        from opsched.policies.exported import load as _load
    except ImportError as exc:
        raise PolicyError(f"{path}: cannot load exported policies in this install ({exc})") from None
    return _load(path)


__all__ = ["BASELINE", "CONTROL", "HINT", "LEARNED", "TEACHER", "Policy", "entries", "expand_names",
           "get_policies", "get_policy", "heuristic_names", "load", "names", "register", "timed_plan"]
