"""Training steps on the TensorFlow runtime: the client side of :mod:`opsched.backends.tf_step_worker`.

A step graph (:class:`~opsched.importers.tf_step.TFStepSource`) runs in the
TensorFlow worker of its plan's ``(inter, intra)`` setting, like an inference
graph (:class:`~opsched.backends.tf_cpu.TFBackend`: pool sizes, control
dependencies and devices from the plan), but every run is one training step
that updates the step's variables *in that worker*.  Which values they start
from is a **state**, named by the caller:

* ``scratch`` (:data:`SCRATCH`) - what :meth:`TFBackend.run`, ``execute``,
  ``time_plan`` and ``measure`` train when given a step graph: the capture's
  values, reset now and then (timing never trains the user's model);
* any other name - a state the caller owns: :func:`push` ships values to it,
  :func:`step` trains it, :func:`pull` reads it back (the scheduled Keras step,
  :class:`opsched.adapters.keras_train.KerasTrainStep`, owns one per object).

A state lives in one worker: pushing to a plan's worker and training under
another plan with other pool sizes trains another copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opsched.backends.tf_wire import array_to_bytes, bytes_to_array
from opsched.errors import ExecutionError
from opsched.graph import OpGraph
from opsched.lru import IdentityLRU

SCRATCH = "scratch"
#: Step graphs run with all of Grappler, its arithmetic optimizer included, as Keras's own
#: ``tf.function`` does: on MobileNetV2 its rewrites move the first step's updates by ~1e-3
#: (an ill-conditioned first step: BatchNorm over batch 4), so only with them does the
#: scheduled step give ``model.fit``'s numbers (per-op trace attribution is the less exact for it).
STEP_ARITHMETIC = True


def is_step(graph: OpGraph) -> bool:
    """The graph is a training step (its source is a TFStepSource)."""
    from opsched.importers.tf_step import TFStepSource

    return isinstance(graph.source, TFStepSource)


def _loaded(be: Any, graph: OpGraph, settings: Any) -> tuple[Any, str]:
    """The worker of ``settings`` with ``graph`` loaded in it, and the graph's key there."""
    src = graph.source
    w = be._worker(settings)
    key = be._graph_key(graph)
    if key not in w.loaded:
        step = {"variables": [[v.node, v.dtype, list(v.shape)] for v in src.variables]}
        be._request(w, {"cmd": "load", "key": key, "feeds": [t.name for t in src.inputs],
                        "fetches": list(src.outputs), "arithmetic": STEP_ARITHMETIC, "step": step},
                    [src.graph_def, *src.initial])
        w.loaded.add(key)
    return w, key


def _feeds(graph: OpGraph, inputs: Sequence[np.ndarray] | None, seed: int) -> list[bytes]:
    src = graph.source
    feeds = list(inputs) if inputs is not None else src.random_inputs(seed)
    if len(feeds) != len(src.inputs):
        raise ExecutionError(f"step graph {graph.name!r} takes {len(src.inputs)} input(s) (x leaves and y), "
                             f"got {len(feeds)}")
    blobs = []
    for t, a in zip(src.inputs, feeds):
        a = np.asarray(a)
        if tuple(a.shape) != tuple(t.shape):
            raise ExecutionError(f"step graph {graph.name!r}: input {t.name!r} needs shape {t.shape}, got {a.shape}")
        blobs.append(array_to_bytes(a.astype(t.dtype, copy=False)))
    return blobs


@dataclass(frozen=True)
class PlanArgs:
    """What a plan becomes in the worker (``TFBackend._plan_args``), with a digest of its placement
    and control dependencies: the worker is sent them once per digest, later calls name the digest."""

    settings: Any
    placement: dict[str, str]
    after: dict[str, list[str]]
    digest: str

    @staticmethod
    def of(settings: Any, placement: Mapping[str, str] | None, after: Mapping[str, Sequence[str]] | None,
           groups: Sequence[tuple[str, Sequence[str], Sequence[str], Sequence[str]]] = ()) -> PlanArgs:
        """From op-level placement and waits; ``groups`` (a coarsened step's, op id -> members, entries,
        exits) turn them into node level: every member where its op is placed, an op's waits put on
        its entry members and on the exits of the ops it waits for."""
        place = dict(placement or {})
        deps = {k: list(v) for k, v in (after or {}).items() if v}
        if groups:
            ends = {g: (entries, exits) for g, _, entries, exits in groups}
            for g, members, _, _ in groups:
                if g in place:
                    place.update(dict.fromkeys(members, place[g]))
            node_deps: dict[str, list[str]] = {}
            for k, v in deps.items():
                waits = sorted({x for d in v for x in (ends[d][1] if d in ends else (d,))})
                for node in (ends[k][0] if k in ends else (k,)):
                    node_deps[node] = sorted(set(node_deps.get(node, ())) | set(waits))
            deps = node_deps
        blob = json.dumps([sorted(place.items()), sorted(deps.items())]).encode()
        return PlanArgs(settings, place, deps, hashlib.sha256(blob).hexdigest()[:24])


_ARGS = IdentityLRU(32)  # per plan: its PlanArgs (a plan is immutable)


def plan_args(be: Any, graph: OpGraph, plan: Any) -> PlanArgs:
    """``be._plan_args(graph, plan)`` as :class:`PlanArgs`, kept per plan."""
    return _ARGS.get_or_make((id(plan), id(graph), id(be)),
                             lambda: _plan_args(be, graph, plan), plan, graph, be)


def _plan_args(be: Any, graph: OpGraph, plan: Any) -> PlanArgs:
    settings, placement, after = be._plan_args(graph, plan)
    return PlanArgs.of(settings, placement, after, graph.source.groups)


def call(be: Any, graph: OpGraph, settings: Any, inputs: Sequence[np.ndarray] | None = None,
         placement: Mapping[str, str] | None = None, after: Mapping[str, Sequence[str]] | None = None,
         warmup: int = 0, repeats: int = 0, trace_runs: int = 0, return_outputs: bool = False,
         state: str = SCRATCH, args: PlanArgs | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``TFBackend._call`` for a step graph: ``warmup + repeats + trace_runs`` steps (at least one)
    of ``state`` in the worker of ``settings``; the reply adds ``losses`` (one per step).  ``args``
    (a plan's :class:`PlanArgs`) replaces ``settings``, ``placement`` and ``after``."""
    args = args or PlanArgs.of(settings, placement, after, graph.source.groups)
    w, key = _loaded(be, graph, args.settings)
    sent = w.__dict__.setdefault("step_copies_sent", set())  # (graph key, digest) pairs this worker knows
    header: dict[str, Any] = {"cmd": "run", "key": key, "state": state, "copy": args.digest, "warmup": warmup,
                              "repeats": repeats, "trace_runs": trace_runs, "return_outputs": return_outputs}
    if (key, args.digest) not in sent:
        header.update(placement=args.placement, after=args.after)
    reply, out = be._request(w, header, _feeds(graph, inputs, be.seed))
    sent.add((key, args.digest))
    if graph.source.groups and (reply.get("traces") or reply.get("misplaced")):  # members -> their op
        lead = {m: g for g, members, _, _ in graph.source.groups for m in members}
        reply["traces"] = [[[lead.get(ev[0], ev[0]), *ev[1:]] for ev in tr] for tr in reply["traces"]]
        reply["misplaced"] = {lead.get(k, k): v for k, v in reply.get("misplaced", {}).items()}
    reply["worker_pid"] = w.pid
    return reply, [bytes_to_array(b) for b in out]


def step(be: Any, graph: OpGraph, plan: Any, state: str, inputs: Sequence[np.ndarray]) -> float:
    """One training step of ``state`` under ``plan``; returns its loss."""
    reply, _ = call(be, graph, None, inputs, state=state, args=plan_args(be, graph, plan))
    return float(reply["losses"][-1])


def push(be: Any, graph: OpGraph, settings: Any, state: str, values: Sequence[np.ndarray],
         which: Sequence[int] | None = None) -> None:
    """Set ``state``'s variables (all, in order, or those at ``which``) in the worker of ``settings``."""
    from opsched.backends.tf_step_worker import pack

    w, key = _loaded(be, graph, settings)
    layout, blob = pack([np.asarray(v) for v in values])
    be._request(w, {"cmd": "state_set", "key": key, "state": state, "layout": layout,
                    "which": None if which is None else [int(i) for i in which]}, [blob])


def pull(be: Any, graph: OpGraph, settings: Any, state: str, which: Sequence[int] | None = None) -> list[np.ndarray]:
    """``state``'s variables (all, or those at ``which``) from the worker of ``settings``."""
    from opsched.backends.tf_step_worker import unpack

    w, key = _loaded(be, graph, settings)
    reply, out = be._request(w, {"cmd": "state_get", "key": key, "state": state,
                                 "which": None if which is None else [int(i) for i in which]})
    return unpack(reply["layout"], out[0])


def drop(be: Any, graph: OpGraph, settings: Any, state: str) -> None:
    """Forget ``state`` in the worker of ``settings`` (nothing happens if it is not loaded there)."""
    w = be._workers.get((settings.inter, settings.intra, 1 + len(be.machine.gpus), be.arithmetic))
    key = be._graph_key(graph)
    if w is not None and key in w.loaded and w.alive():
        be._request(w, {"cmd": "state_drop", "key": key, "state": state})


def peak_rss_bytes(pid: int) -> int | None:
    """A process's peak resident set size (``VmHWM`` of ``/proc/PID/status``; None where unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


__all__ = ["SCRATCH", "STEP_ARITHMETIC", "PlanArgs", "call", "drop", "is_step", "peak_rss_bytes", "plan_args", "pull", "push", "step"]
