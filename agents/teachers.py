"""The imitation teacher: the best known plan of each training pair, cached on disk.

Why not the best heuristic: imitating it caps the policy at the heuristics'
quality, and on the validation split the heuristics the policy sees as its
hint (:func:`opsched.policies.hints.hint_names`) are 3.8% (geometric mean)
behind the best of every baseline, the moldable-task ones included
(``docs/learning.md``).  The teacher of a (graph, machine) pair is instead
the best plan a short search finds, the way :func:`opsched.ceiling.best_known`
finds one but within a training budget:

1. every baseline heuristic plans the graph (``names(BASELINE)``: HEFT,
   critical-path-first, CPA, biCPA, LP rounding, ...), each plan projected
   onto the episode's op slots (:func:`opsched.engine.slots.from_plan`) and
   replayed there;
2. the fastest is improved by iterated local search on those slots
   (:func:`opsched.policies.refine.iterated_slot_search`, ``steps`` simulations), so
   the teacher is a plan of exactly the episodes the policy plays, coarsened
   graphs included.

CP-SAT and a long Optuna search (the rest of ``best_known``) cost seconds to
minutes per pair: too much for the hundreds of pairs a training run imitates
within its budget (a teacher here costs 0.1-1 s on one core).

Teachers are cached per (graph, machine, planning model, slots, search
budget) as JSON plans in the per-user cache (:func:`opsched.cache.root`
``/teachers``): the first run pays, every later run (another seed, a resume)
reads them.  Only the analytic model's teachers go to disk (a fitted model
has no stable identity to key them by); others are kept in memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from opsched.engine.slots import SlotPlan, best_of, from_plan, makespan, to_plan
from opsched.lru import IdentityLRU

#: Bump when the teacher's recipe changes: older cache entries are then ignored.
TEACHER_VERSION = 1
#: Local-search simulations per pair (the ``teacher_steps`` hyperparameter's default).
DEFAULT_STEPS = 400

_MEMORY = IdentityLRU(8192)


@dataclass
class Teacher:
    """One pair's teacher: its slot plan (``plan.makespan`` simulated on the
    episode's slots), where it came from, and the best hint heuristic's
    makespan on the same slots (what the policy's observation starts from)."""

    plan: SlotPlan
    source: str
    hint_makespan: float

    @property
    def gain(self) -> float:
        """Teacher makespan over the hint's (< 1: the teacher is faster)."""
        return self.plan.makespan / self.hint_makespan if self.hint_makespan > 0 else 1.0


def teachers_dir() -> Path:
    """Where teacher plans are cached (``<cache>/teachers``)."""
    from opsched.cache import root

    return root() / "teachers"


def _key(data: Any, model: Any, steps: int, seed: int) -> str | None:
    """The cache file name of a pair's teacher (None: not cached on disk)."""
    if model is not None and getattr(model, "name", "") != "analytic":
        return None
    from opsched.engine.sim import cached_fingerprint
    from opsched.policies.registry import BASELINE, names

    blob = json.dumps([TEACHER_VERSION, cached_fingerprint(data.graph), cached_fingerprint(data.machine),
                       int(data.max_nodes), int(steps), int(seed), list(names(BASELINE))])
    return hashlib.sha256(blob.encode()).hexdigest()[:32] + ".json"


def teacher(data: Any, model: Any = None, steps: int = DEFAULT_STEPS, seed: int = 0,
            cache: bool = True) -> Teacher:
    """The teacher of one episode's pair (``data``: the env's
    :class:`~opsched.engine.observe.EpisodeData`; ``model``: the env's
    planning model, None for the analytic one); see the module docstring."""
    key = _key(data, model, steps, seed) if cache else None

    def make() -> Teacher:
        found = _read(data, key) if key else None
        if found is None:
            found = _search(data, model, steps, seed)
            if key:
                _write(data, key, found)
        return found

    return _MEMORY.get_or_make((id(data), int(steps), int(seed)), make, data)


def _search(data: Any, model: Any, steps: int, seed: int) -> Teacher:
    from opsched.policies.hints import heuristic_plans, hint_names
    from opsched.policies.refine import iterated_slot_search
    from opsched.policies.registry import BASELINE, names

    plans = heuristic_plans(data.graph, data.machine, model, names(BASELINE))
    slots = {name: from_plan(data, plan, f"heuristic:{name}") for name, (plan, _) in plans.items()}
    start = best_of(data, list(slots.values()))
    hint = min(slots[name].makespan for name in hint_names() if name in slots)
    found = iterated_slot_search(data, start, steps, np.random.default_rng([seed, 0x7EAC]))
    if not found.makespan < start.makespan * (1.0 - 1e-9):
        found = start
    return Teacher(found, found.source, float(hint))


def _read(data: Any, key: str) -> Teacher | None:
    """A cached teacher, or None when there is none or it does not fit (then it is made again)."""
    from opsched.errors import OpschedError
    from opsched.plan import Plan

    path = teachers_dir() / key
    try:
        body = json.loads(path.read_text())
        plan = Plan.from_dict(body["plan"], where=str(path))
        sp = from_plan(data, plan, str(body["source"]))
        hint = float(body["hint_makespan"])
    except (OSError, ValueError, KeyError, TypeError, OpschedError):
        return None
    if not np.isfinite(makespan(data, sp)):
        return None
    return Teacher(sp, sp.source, hint)


def _write(data: Any, key: str, found: Teacher) -> None:
    from opsched.io import atomic_write_text

    plan = to_plan(data, found.plan, "teacher")
    body = {"graph": data.graph.name, "machine": data.machine.name, "slots": int(data.n),
            "source": found.source, "makespan_s": float(found.plan.makespan),
            "hint_makespan": float(found.hint_makespan), "plan": plan.to_dict()}
    try:
        atomic_write_text(teachers_dir() / key, json.dumps(body) + "\n")
    except OSError:  # a read-only cache costs the next run the search, nothing else
        pass


def teacher_for_env(env: Any, steps: int = DEFAULT_STEPS, seed: int = 0) -> SlotPlan:
    """The teacher of ``env``'s current episode, as the slot plan imitation labels states with."""
    unwrapped = env.unwrapped
    return teacher(unwrapped.episode_data, unwrapped.model, steps, seed).plan.copy()


__all__ = ["DEFAULT_STEPS", "TEACHER_VERSION", "Teacher", "teacher", "teacher_for_env", "teachers_dir"]
