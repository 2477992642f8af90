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

3. on small graphs (at most :data:`CPSAT_MAX_OPS` ops), with ``cpsat_s`` > 0
   (the ``teacher_cpsat_s`` hyperparameter, 0.25 in the default run): CP-SAT
   (:func:`opsched.engine.bounds.cpsat_schedule`), seeded with that plan and
   the LP bound, for ``cpsat_s`` units of its deterministic time (the same
   answer on a busy machine and a quiet one), its incumbent replayed on the
   slots and polished by a short local search; it replaces the plan when it
   is faster (CP-SAT's model ignores co-run interference, so its plan can be
   slower).  Measured on 30 random small training pairs (``python -m
   opsched.benchmarks.teacher_cpsat``): with 0.25 the teacher got faster on
   17 (by up to 17%), 2.6% faster in geometric mean, at 0.70 s per pair
   instead of 0.12 s (0.5: 18 pairs, 2.8%, 0.83 s; 1.0: the same as 0.5 at
   1.24 s).  One solver process serves every pair
   (:class:`~opsched.engine.bounds.CpSatServer`).

A long Optuna search (the rest of ``best_known``) costs minutes per pair, and
CP-SAT on graphs of hundreds of ops more than seconds: too much for the
hundreds of pairs a training run imitates within its budget.

Teachers are cached per (graph, machine, planning model, slots, search
budget) as JSON plans in the per-user cache (:func:`opsched.cache.root`
``/teachers``): the first run pays, every later run (another seed, a resume)
reads them.  Only the analytic model's teachers go to disk (a fitted model
has no stable identity to key them by); others are kept in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from opsched.engine.slots import SlotPlan, best_of, from_plan, makespan, to_plan
from opsched.lru import IdentityLRU

#: Bump when the teacher's recipe changes: older cache entries are then ignored.
#: 2: coarse groups are projected by where the plan spends their time as well (engine/slots.from_plan).
TEACHER_VERSION = 2
#: Local-search simulations per pair (the ``teacher_steps`` hyperparameter's default).
DEFAULT_STEPS = 400
#: The largest graphs (ops) CP-SAT refines a teacher of: its model grows with ops x modes, and past a
#: few dozen ops a second of search rarely beats the local search's plan.
CPSAT_MAX_OPS = 40

_MEMORY = IdentityLRU(8192)


@dataclass
class Teacher:
    """One pair's teacher: its slot plan (``plan.makespan`` simulated on the
    episode's slots), where it came from, and the best hint heuristic's
    makespan on the same slots (what the policy's observation starts from)."""

    plan: SlotPlan
    source: str
    hint_makespan: float
    #: False when a stage of the recipe failed (CP-SAT's solver): then it is not cached, so a later run retries
    complete: bool = True

    @property
    def gain(self) -> float:
        """Teacher makespan over the hint's (< 1: the teacher is faster)."""
        return self.plan.makespan / self.hint_makespan if self.hint_makespan > 0 else 1.0


def teachers_dir() -> Path:
    """Where teacher plans are cached (``<cache>/teachers``)."""
    from opsched.cache import root

    return root() / "teachers"


def _key(data: Any, model: Any, steps: int, seed: int, cpsat_s: float = 0.0) -> str | None:
    """The cache file name of a pair's teacher (None: not cached on disk)."""
    if model is not None and getattr(model, "name", "") != "analytic":
        return None
    from opsched.engine.sim import cached_fingerprint
    from opsched.policies.registry import BASELINE, names

    parts: list[Any] = [TEACHER_VERSION, cached_fingerprint(data.graph), cached_fingerprint(data.machine),
                        int(data.max_nodes), int(steps), int(seed), list(names(BASELINE))]
    if _uses_cpsat(data, cpsat_s):  # teachers without CP-SAT keep the keys they had before it
        parts.append(["cpsat", float(cpsat_s), CPSAT_MAX_OPS])
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:32] + ".json"


def teacher(data: Any, model: Any = None, steps: int = DEFAULT_STEPS, seed: int = 0,
            cache: bool = True, cpsat_s: float = 0.0) -> Teacher:
    """The teacher of one episode's pair (``data``: the env's
    :class:`~opsched.engine.observe.EpisodeData`; ``model``: the env's
    planning model, None for the analytic one); see the module docstring."""
    key = _key(data, model, steps, seed, cpsat_s) if cache else None

    def make() -> Teacher:
        found = _read(data, key) if key else None
        if found is None:
            found = _search(data, model, steps, seed, cpsat_s)
            if key and found.complete:
                _write(data, key, found)
        return found

    return _MEMORY.get_or_make((id(data), int(steps), int(seed), float(cpsat_s)), make, data)


def _uses_cpsat(data: Any, cpsat_s: float) -> bool:
    """Whether this pair's teacher gets the CP-SAT stage (small graph, stage on, OR-Tools installed)."""
    if not cpsat_s > 0 or len(data.graph.ops) > CPSAT_MAX_OPS:
        return False
    import importlib.util

    return importlib.util.find_spec("ortools") is not None


_SERVERS: dict[float, Any] = {}


def _server(cpsat_s: float) -> Any:
    """The process-wide CP-SAT solver process for this deterministic time (closed at exit)."""
    server = _SERVERS.get(cpsat_s)
    if server is None:
        import atexit

        from opsched.engine.bounds import CpSatServer

        server = _SERVERS[cpsat_s] = CpSatServer(deterministic_s=cpsat_s)
        atexit.register(server.close)
    return server


def _cpsat_stage(data: Any, model: Any, found: SlotPlan, cpsat_s: float, steps: int,
                 seed: int) -> SlotPlan | None:
    """``found`` or, when faster on the slots, CP-SAT's plan seeded with it (then a
    short local search); see step 3 of the module docstring.  None when the
    solver failed: the teacher is then the local search's, as without the
    stage, and is not cached."""
    from opsched.engine.bounds import allocation_lp_bound, cpsat_schedule
    from opsched.errors import OpschedError
    from opsched.policies.refine import local_search

    graph, machine = data.graph, data.machine
    try:
        lp = allocation_lp_bound(graph, machine, model)
        res = cpsat_schedule(graph, machine, model, max(10.0, 5.0 * cpsat_s), hint=to_plan(data, found, "teacher"),
                             lower_bound=lp, seed=seed, solver=_server(cpsat_s))
    except OpschedError:
        return None
    if res.plan is None:
        return found
    cand = from_plan(data, res.plan, "cpsat")
    if not np.isfinite(makespan(data, cand)):
        return found
    cand = local_search(data, cand, max(1, steps // 4), np.random.default_rng([seed, 0xC95A7]))
    if cand.makespan < found.makespan * (1.0 - 1e-9):
        cand.source = "cpsat" if cand.source == "cpsat" else "search(cpsat)"
        return cand
    return found


def _search(data: Any, model: Any, steps: int, seed: int, cpsat_s: float = 0.0) -> Teacher:
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
    complete = True
    if _uses_cpsat(data, cpsat_s):
        refined = _cpsat_stage(data, model, found, cpsat_s, steps, seed)
        complete = refined is not None
        found = found if refined is None else refined
    return Teacher(found, found.source, float(hint), complete)


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


@dataclass(frozen=True)
class TeacherSettings:
    """How hard the teacher searches: the ``teacher_steps`` and
    ``teacher_cpsat_s`` hyperparameters, read from the run's config in one
    place (:meth:`from_hyperparameters`) and handed to rollout workers, local
    or Ray actors, as one plain mapping (:meth:`as_dict` / :meth:`from_dict`),
    so a new teacher setting is added here and nowhere else."""

    steps: int = DEFAULT_STEPS
    cpsat_s: float = 0.0

    @classmethod
    def from_hyperparameters(cls, ppo: Mapping[str, Any]) -> TeacherSettings:
        """The settings of a run's ``ppo`` hyperparameters (absent: the defaults here)."""
        return cls(int(ppo.get("teacher_steps", DEFAULT_STEPS)), float(ppo.get("teacher_cpsat_s", 0.0)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> TeacherSettings:
        d = d or {}
        return cls(int(d.get("steps", DEFAULT_STEPS)), float(d.get("cpsat_s", 0.0)))

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "cpsat_s": self.cpsat_s}

    def teach(self, data: Any, model: Any = None, seed: int = 0) -> Teacher:
        """:func:`teacher` of one episode's pair with these settings."""
        return teacher(data, model, self.steps, seed, cpsat_s=self.cpsat_s)


def teacher_for_env(env: Any, settings: TeacherSettings | None = None, seed: int = 0) -> SlotPlan:
    """The teacher of ``env``'s current episode, as the slot plan imitation labels states with."""
    unwrapped = env.unwrapped
    return (settings or TeacherSettings()).teach(unwrapped.episode_data, unwrapped.model, seed).plan.copy()


__all__ = ["CPSAT_MAX_OPS", "DEFAULT_STEPS", "TEACHER_VERSION", "Teacher", "TeacherSettings", "teacher", "teacher_for_env", "teachers_dir"]
