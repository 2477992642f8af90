"""The one registry of policies: every heuristic registers itself, with its roles.

A heuristic is one module in ``policies/`` whose class carries the
:func:`register` decorator; nothing else names it.  The registry finds the
modules of this package on first use (:func:`entries`), so adding a
heuristic is that module plus its test::

    @register("my-heuristic", roles=(BASELINE,), aliases=("mine",))
    class Mine(Policy):
        name = "my-heuristic"
        def plan(self, graph, machine, model=None) -> Plan: ...

Roles say what a policy is used for, and every consumer reads them here:

* :data:`BASELINE` -- what opsched is measured against: ``compare --policies
  all``, the benchmark report, the training run's evaluations, ``apply_zoo``;
* :data:`HINT` -- its plans are the learned policy's observation hint (the
  best of them, ``hint_*`` columns) and its default plan-time candidates.  The
  set is part of an exported policy's observation: ``policy.json`` records it
  and the loaded policy plans with the set it was trained with
  (:attr:`opsched.policies.exported.ExportedPolicy.hints`), so adding a hint
  heuristic never silently changes what an exported policy sees;
* :data:`TEACHER` -- imitation learning copies the fastest of them per pair;
* :data:`CONTROL` -- a sanity reference that is in ``all`` but is neither a
  baseline to beat nor a teacher (the random plan).

A policy registered with no role (``search``, ``ort-lanes``) is reachable by
name only.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from opsched.errors import PolicyError
from opsched.policies.base import Policy

BASELINE, HINT, TEACHER, CONTROL = "baseline", "hint", "teacher", "control"
ROLES = (BASELINE, HINT, TEACHER, CONTROL)

_PACKAGE = __name__.rpartition(".")[0]  # opsched.policies
#: Modules of this package that hold no registered policy (not imported by discovery).
_NOT_POLICIES = frozenset({"base", "registry", "exported", "numpy_encoder", "refine", "hints"})

P = TypeVar("P", bound=type[Policy])


@dataclass(frozen=True)
class Entry:
    """One registered policy: its name, class, roles, aliases and place in listings."""

    name: str
    cls: type[Policy]
    roles: frozenset[str]
    aliases: tuple[str, ...]
    order: int
    description: str

    def make(self, **kwargs: Any) -> Policy:
        return self.cls(**kwargs)


_ENTRIES: dict[str, Entry] = {}
_ALIASES: dict[str, str] = {}
_LOCK = threading.RLock()
_discovered = False


def register(name: str, *, roles: Iterable[str] = (BASELINE,), aliases: Iterable[str] = (),
             order: int = 100) -> Callable[[P], P]:
    """Class decorator: register a :class:`~opsched.policies.base.Policy` subclass as ``name``.

    ``order``: where it is listed (``all`` keeps this order; sequential, the
    reference, is 0); ties by name."""
    roles = frozenset(roles)
    bad = roles - set(ROLES)
    if bad:
        raise ValueError(f"register({name!r}): unknown roles {sorted(bad)}; choose from {ROLES}")

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register({name!r}) decorates a Policy subclass, not {cls!r}")
        doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        entry = Entry(name, cls, roles, tuple(aliases), order, doc)
        with _LOCK:
            old = _ENTRIES.get(name)
            if old is not None and old.cls.__qualname__ != cls.__qualname__:
                raise ValueError(f"policy name {name!r} is registered twice ({old.cls.__module__} and "
                                 f"{cls.__module__})")
            _ENTRIES[name] = entry
            for a in entry.aliases:
                _ALIASES[a] = name
        return cls

    return deco


def _discover() -> None:
    """Import every policy module of this package once (each registers its classes)."""
    global _discovered
    with _LOCK:
        if _discovered:
            return
        package = sys.modules.get(_PACKAGE)
        paths = list(getattr(package, "__path__", None) or [str(Path(__file__).resolve().parent)])
        for info in pkgutil.iter_modules(paths):
            if info.name.startswith("_") or info.name in _NOT_POLICIES:
                continue
            importlib.import_module(f"{_PACKAGE}.{info.name}")
        _discovered = True


def entries() -> list[Entry]:
    """Every registered policy, in listing order."""
    _discover()
    with _LOCK:
        return sorted(_ENTRIES.values(), key=lambda e: (e.order, e.name))


def names(role: str | None = None) -> tuple[str, ...]:
    """Registered names (with ``role`` when given), in listing order."""
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose from {ROLES}")
    return tuple(e.name for e in entries() if role is None or role in e.roles)


def canonical(name: str) -> str:
    """``name`` with an alias resolved (unknown names are returned as they are)."""
    _discover()
    return _ALIASES.get(name, name)


def entry(name: str) -> Entry:
    """The registered policy called ``name`` (or an alias of it)."""
    key = canonical(name)
    with _LOCK:
        found = _ENTRIES.get(key)
    if found is None:
        raise PolicyError(f"unknown policy {name!r}; choose from {', '.join(names())}")
    return found


def aliases() -> dict[str, str]:
    """alias -> name."""
    _discover()
    with _LOCK:
        return dict(_ALIASES)


__all__ = ["BASELINE", "CONTROL", "HINT", "ROLES", "TEACHER", "Entry", "aliases", "canonical", "entries", "entry",
           "names", "register"]
