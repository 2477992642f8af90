"""The contract every backend passes (issue 3): ``run(graph, plan) -> Trace``.

Parametrized over the backend registry (:data:`opsched.backends.registry.BACKENDS`):
a new backend is tested by its registry entry alone.  A backend whose framework
is missing is skipped; one that needs CUDA carries the ``gpu`` marker.  For every plan kind (all cores,
one thread, mixed threads and priorities, extra ``after`` waits):

* exactly one event per op, with the plan's device and threads;
* each event starts no earlier than every predecessor's (data and ``after``) end;
* no device's slot capacity is exceeded at any instant; where the backend
  records cores, each op holds ``threads`` distinct cores of its device and
  no core runs two ops at once;
* makespan > 0;
* a plan made for another graph or another machine raises PlanError;
* on one core slot, ops run in exactly the greedy priority order of
  ``opsched/plan.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
from heapq import heappop, heappush

import pytest

from opsched.backends.registry import BACKENDS  # noqa: E402
from opsched.errors import PlanError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Assignment, Plan, uniform_plan
from opsched.trace import Trace


def _machine(cores: int, name: str | None = None) -> Machine:
    probe = Machine.probe()
    cpu = dataclasses.replace(probe.cpu, cores=cores)
    return Machine(name or f"contract-{cores}c", (cpu,), description="contract-test machine")


def _torch_graph() -> OpGraph:
    import torch
    from _nets import Branchy

    from opsched.importers.torch_fx import from_torch

    torch.manual_seed(0)
    return from_torch(Branchy().eval(), (torch.randn(2, 3, 16, 16),), name="branchy")


def _tf_graph() -> OpGraph:
    import tensorflow as tf

    from opsched.importers.tf_graph import from_tf_function

    w = [tf.constant(float(i + 1) * 0.01, shape=(32, 32)) for i in range(3)]

    def fn(x):
        a = tf.nn.relu(tf.matmul(x, w[0]))
        b = tf.sigmoid(tf.matmul(x, w[1]))
        c = tf.tanh(tf.matmul(x, w[2]))
        return tf.reduce_sum(a + b * c, axis=1)

    return from_tf_function(fn, [tf.TensorSpec((8, 32), tf.float32)], name="tf-branchy")


def _ort_graph() -> OpGraph:
    """Branchy exported to ONNX: the graph ONNX Runtime runs (needs onnx and onnxruntime)."""
    import onnxruntime  # noqa: F401
    import torch
    from _nets import Branchy

    from opsched.importers.onnx_graph import from_torch_via_onnx

    torch.manual_seed(0)
    return from_torch_via_onnx(Branchy().eval(), (torch.randn(2, 3, 16, 16),), name="branchy-onnx")


#: An executable graph for each importer a backend spec ``runs`` ("any": the simulator runs every graph).
_GRAPH_OF = {"any": _torch_graph, "torch": _torch_graph, "keras": _tf_graph, "onnx": _ort_graph}


def _open(name: str, machine: Machine):
    spec = BACKENDS[name]
    why = spec.missing()
    if why is not None:
        pytest.skip(why)
    module = spec.target.partition(":")[0]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"backend {name!r} does not import here: {exc}")
    from opsched.backends.registry import get_backend

    return get_backend(name, machine)


def _marks(name: str) -> list:
    spec = BACKENDS[name]
    return ([pytest.mark.gpu] if spec.cuda else []) + (
        [pytest.mark.tf, pytest.mark.slow] if "tensorflow" in spec.requires else [])


@pytest.fixture(scope="module", params=[pytest.param(name, marks=_marks(name)) for name in BACKENDS])
def setup(request):
    """(backend name, backend on a 2-slot machine, an executable graph, the machine)."""
    name = request.param
    machine = _machine(2)
    backend = _open(name, machine)
    try:
        graph = _GRAPH_OF[BACKENDS[name].runs[0]]()
    except ImportError as exc:
        backend.close()
        pytest.skip(f"no framework for {name!r}: {exc}")
    yield name, backend, graph, machine
    backend.close()


def _plans(graph: OpGraph, machine: Machine) -> dict[str, Plan]:
    rng = random.Random(7)
    cores = machine.cpu.cores
    mixed = {op.id: Assignment("cpu", rng.randint(1, cores), rng.random()) for op in graph.ops}
    topo = [graph.ops[i].id for i in graph.topo_index]
    pos = {op_id: k for k, op_id in enumerate(topo)}
    waits = {}
    for op_id, a in mixed.items():
        earlier = topo[: pos[op_id]]
        after = tuple(rng.sample(earlier, min(2, len(earlier)))) if earlier and rng.random() < 0.4 else ()
        waits[op_id] = dataclasses.replace(a, priority=-a.priority, after=after)
    return {
        "all-cores": uniform_plan(graph, machine, cores, policy="all-cores"),
        "one-thread": uniform_plan(graph, machine, 1, policy="one-thread"),
        "mixed": Plan.build(graph, machine, mixed, policy="mixed"),
        "after": Plan.build(graph, machine, waits, policy="after"),
    }


def check_trace(trace: Trace, graph: OpGraph, plan: Plan, machine: Machine) -> None:
    """Assert the contract on one trace (shared with other backends' tests)."""
    assert isinstance(trace, Trace)
    ev = trace.by_op()
    assert len(trace.events) == len(graph.ops), "exactly one event per op"
    assert set(ev) == {op.id for op in graph.ops}
    for op in graph.ops:
        e, a = ev[op.id], plan[op.id]
        assert (e.device, e.threads) == (a.device, a.threads), f"op {op.id}: event does not match the plan"
        assert e.end >= e.start >= 0.0
        for p in set(graph.predecessors(op.id)) | set(a.after):
            assert e.start >= ev[p].end, f"op {op.id} started before its dependency {p} ended"
    # Slot capacity at every instant: sweep starts and ends (an end frees its slots first).
    for dev in machine.devices:
        points = sorted([(e.end, 0, -e.threads) for e in trace.events if e.device == dev.id]
                        + [(e.start, 1, e.threads) for e in trace.events if e.device == dev.id])
        load = 0
        for _, _, delta in points:
            load += delta
            assert load <= dev.cores, f"device {dev.id} over its {dev.cores} slots"
    with_cores = [e for e in trace.events if e.cores is not None]
    for e in with_cores:
        assert len(set(e.cores)) == e.threads, f"op {e.op} holds {e.cores} for {e.threads} threads"
        assert all(0 <= c < machine.device(e.device).cores for c in e.cores)
    for i, x in enumerate(with_cores):
        for y in with_cores[i + 1:]:
            if x.device == y.device and x.start < y.end and y.start < x.end:
                assert not set(x.cores) & set(y.cores), f"ops {x.op} and {y.op} share a core at once"
    assert trace.makespan > 0


def greedy_order(graph: OpGraph, plan: Plan) -> list[str]:
    """The plan semantics on one slot: repeatedly start the highest-priority ready op."""
    n = len(graph.ops)
    deps = [set(graph.pred_index[i]) | {graph.index[d] for d in plan[op.id].after} for i, op in enumerate(graph.ops)]
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(deps):
        for j in d:
            succ[j].append(i)
    left = [len(d) for d in deps]
    key = [(-plan[op.id].priority, i) for i, op in enumerate(graph.ops)]
    ready = [key[i] for i in range(n) if not left[i]]
    ready.sort()
    out = []
    while ready:
        _, i = heappop(ready)
        out.append(graph.ops[i].id)
        for s in succ[i]:
            left[s] -= 1
            if not left[s]:
                heappush(ready, key[s])
    return out


@pytest.mark.parametrize("kind", ["all-cores", "one-thread", "mixed", "after"])
def test_trace_contract(setup, kind):
    name, backend, graph, machine = setup
    plan = _plans(graph, machine)[kind]
    for _ in range(2):  # twice: a real backend's second run reuses its compiled plan and threads
        check_trace(backend.run(graph, plan), graph, plan, machine)


def test_plan_for_another_graph_or_machine_is_refused(setup):
    name, backend, graph, machine = setup
    other_graph = OpGraph(graph.ops[:-1], tuple(e for e in graph.edges if e.dst != graph.ops[-1].id
                                                 and e.src != graph.ops[-1].id), name="other")
    foreign = uniform_plan(other_graph, machine, 1)
    with pytest.raises(PlanError):
        backend.run(graph, foreign)
    other_machine = _machine(3, "contract-other")
    with pytest.raises(PlanError, match="different machine"):
        backend.run(graph, uniform_plan(graph, other_machine, 1))


def test_one_slot_runs_the_greedy_priority_order(setup):
    name, _, graph, _ = setup
    machine = _machine(1)
    backend = _open(name, machine)
    try:
        rng = random.Random(3)
        plan = Plan.build(graph, machine, {op.id: Assignment("cpu", 1, float(rng.randint(0, 3))) for op in graph.ops})
        trace = backend.run(graph, plan)
        check_trace(trace, graph, plan, machine)
        ran = [e.op for e in sorted(trace.events, key=lambda e: (e.start, e.end))]
        assert ran == greedy_order(graph, plan)
    finally:
        backend.close()


def test_the_contract_check_catches_violations(diamond):
    """The checker itself can fail: each broken trace below is rejected."""
    from opsched.trace import TraceEvent

    machine = _machine(2)
    plan = uniform_plan(diamond, machine, 1)
    good = [TraceEvent("a", 0.0, 1.0, "cpu", 1, (0,)), TraceEvent("b", 1.0, 2.0, "cpu", 1, (0,)),
            TraceEvent("c", 1.0, 3.0, "cpu", 1, (1,)), TraceEvent("d", 3.0, 4.0, "cpu", 1, (0,))]
    check_trace(Trace(tuple(good)), diamond, plan, machine)
    broken = {
        "missing op": good[:3],
        "early start": [good[0], good[1], good[2], TraceEvent("d", 2.5, 4.0, "cpu", 1, (0,))],
        "shared core": [good[0], TraceEvent("b", 1.0, 2.0, "cpu", 1, (1,)), good[2], good[3]],
        "wrong threads": [TraceEvent("a", 0.0, 1.0, "cpu", 2, (0, 1)), *good[1:]],
    }
    for what, events in broken.items():
        with pytest.raises(AssertionError):
            check_trace(Trace(tuple(events)), diamond, plan, machine)
            pytest.fail(f"{what} was not caught")
    wide = Plan.build(diamond, machine, {**plan.assignments, "b": Assignment("cpu", 2, 0.0)})
    over = [good[0], TraceEvent("b", 1.0, 2.0, "cpu", 2, None), TraceEvent("c", 1.0, 3.0, "cpu", 1, None), good[3]]
    with pytest.raises(AssertionError, match="over its 2 slots"):
        check_trace(Trace(tuple(over)), diamond, wide, machine)
