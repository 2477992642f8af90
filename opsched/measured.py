"""Choose among a policy's candidate plans by timing them on the real runtime.

The planning model ranks plans well (Spearman 0.93 over the zoo) but its
errors are about 12% per plan, and plan-time search exploits exactly those
errors: the plan the model likes best is often one whose predicted gain the
runtime does not deliver (docs/learning.md, "apply on the zoo").  So
``opsched.apply`` does what an autotuner does with a shortlist: it times the
``top`` fastest distinct candidates under the model (the learned policy's
decodings, the heuristics, the refined plan), plus the sequential plan as a
baseline, on the runtime that will run them, on the example inputs, and keeps
the fastest median.  It costs about ``(top + 1) x (warmup + repeats)``
inferences once, at apply time; ``measure=0`` (or 1) keeps the model's choice.

What was measured lands in the plan: ``plan.meta["measured"]`` (origin ->
median seconds), ``plan.meta["model_choice"]`` (what the model alone chose)
and ``plan.meta["chosen"]``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from opsched.errors import OpschedError
from opsched.graph import OpGraph
from opsched.plan import Plan
from opsched.timing import interleave

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend

#: Candidates ``opsched.apply`` times by default, warm-up calls and timed rounds each.
DEFAULT_TOP, WARMUP, REPEATS = 3, 1, 5
#: Always timed too when it is a candidate: the plain sequential plan (every op
#: alone with all cores, what eager execution does), so the choice is never a
#: plan the model liked that runs slower here than doing nothing clever.
BASELINE = "heuristic:sequential"


def shortlist(candidates: Mapping[str, tuple[Plan, float]], top: int,
              always: Sequence[str] = (BASELINE,)) -> dict[str, Plan]:
    """The ``top`` candidates with the smallest predicted makespan, one per
    distinct schedule (two origins often yield the same plan), fastest first;
    then those named in ``always`` that are candidates and not yet in."""
    ranked = sorted(candidates.items(), key=lambda kv: (not math.isfinite(kv[1][1]), kv[1][1]))
    out: dict[str, Plan] = {}
    seen: set[frozenset] = set()

    def add(name: str, plan: Plan) -> None:
        key = frozenset(plan.assignments.items())
        if key not in seen:
            seen.add(key)
            out[name] = plan

    for name, (plan, _) in ranked:
        if len(out) == top:
            break
        add(name, plan)
    for name in always:
        if name in candidates:
            add(name, candidates[name][0])
    return out


@runtime_checkable
class SelfTimed(Protocol):
    """A backend with its own clock (the TensorFlow worker times inside its process)."""

    def time_plan(self, graph: OpGraph, plan: Plan, repeats: int = 10, warmup: int = 2,
                  inputs: Sequence[Any] | None = None) -> list[float]: ...


def plan_timer(backend: Backend, graph: OpGraph, plan: Plan, inputs: Sequence[Any]) -> Callable[[], float]:
    """A callable returning the seconds of one run of ``plan`` on ``backend``:
    the backend's own clock when it has one (:class:`SelfTimed`: the TensorFlow
    worker times inside its process), else the wall clock around ``execute``."""
    if isinstance(backend, SelfTimed):
        return lambda: float(backend.time_plan(graph, plan, repeats=1, warmup=0, inputs=list(inputs))[0])

    def once() -> float:
        import torch

        with torch.no_grad():
            t0 = time.perf_counter()
            backend.execute(graph, plan, inputs)
            return time.perf_counter() - t0

    return once


def choose_measured(backend: Backend, graph: OpGraph, candidates: Mapping[str, tuple[Plan, float]],
                    inputs: Sequence[Any], top: int = DEFAULT_TOP, warmup: int = WARMUP,
                    repeats: int = REPEATS, always: Sequence[str] = (BASELINE,),
                    wrap: Callable[[Callable[[], float]], Callable[[], float]] | None = None) -> Plan:
    """The fastest of the ``top`` model-ranked candidates (and those named in
    ``always``), timed on ``backend`` (interleaved rounds, medians; ``wrap``
    wraps each timer, e.g. a pause that lets another runtime's spinning threads
    stop).  A candidate whose run fails is dropped; when all fail the error
    propagates.  With fewer than two distinct candidates nothing is timed and
    the model's choice is returned."""
    short = shortlist(candidates, max(1, top), always)
    model_choice = next(iter(short))
    if len(short) < 2:
        return short[model_choice]
    t0 = time.perf_counter()
    timers: dict[str, Callable[[], float]] = {}
    error: OpschedError | None = None
    for name, plan in short.items():
        timer = plan_timer(backend, graph, plan, inputs)
        try:
            timer()  # also the first warm-up call: a plan that cannot run is dropped here
        except OpschedError as exc:
            error = error or exc
            continue
        timers[name] = timer if wrap is None else wrap(timer)
    if not timers:
        assert error is not None
        raise error
    timings = interleave(timers, warmup=max(0, warmup - 1), repeats=max(1, repeats))
    medians = {k: timings.median(k) for k in timers}
    best = min(medians, key=medians.__getitem__)
    plan = short[best]
    meta = {**plan.meta, "chosen": best, "model_choice": model_choice, "measured": medians,
            "measured_load": timings.load_record(),
            "measure_s": time.perf_counter() - t0}
    return Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint, plan.policy, meta)


__all__ = ["BASELINE", "DEFAULT_TOP", "REPEATS", "WARMUP", "SelfTimed", "choose_measured", "plan_timer",
           "shortlist"]
