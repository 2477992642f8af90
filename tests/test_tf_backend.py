"""The TensorFlow backend: real runs in worker processes, valid traces, the model's own outputs.

Every worker process imports TensorFlow (seconds), so the tests share one
backend and reuse few (inter, intra) settings.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import numpy as np
import pytest

from opsched.errors import ExecutionError, PlanError
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import Device, Link, Machine
from opsched.plan import Assignment, Plan, uniform_plan
from opsched.trace import Trace

pytestmark = pytest.mark.tf


def _machine(cores: int = 2, gpus: int = 0) -> Machine:
    cpu = dataclasses.replace(Machine.probe().cpu, cores=cores)
    devices = [cpu] + [Device(f"gpu:{i}", "gpu", 2, 1000.0, 100.0, 1.0, name="stand-in") for i in range(gpus)]
    links = [Link("cpu", f"gpu:{i}", 10.0, 5.0) for i in range(gpus)]
    return Machine(f"tf-test-{cores}c{gpus}g", tuple(devices), tuple(links))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is not alive either.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def model(tf):
    """A small branchy Keras model: three parallel branches joined by a concat."""
    keras = tf.keras
    tf.random.set_seed(0)
    x = keras.Input((16, 16, 3))
    s = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(s)
    b = keras.layers.DepthwiseConv2D(3, padding="same")(s)
    b = keras.layers.Conv2D(8, 1, activation="sigmoid")(b)
    c = keras.layers.MaxPooling2D(2, strides=1, padding="same")(s)
    y = keras.layers.Concatenate()([a, b, c])
    y = keras.layers.BatchNormalization()(y)
    y = keras.layers.GlobalAveragePooling2D()(y)
    out = keras.layers.Dense(10, activation="softmax")(y)
    return keras.Model(x, out, name="branchy")


@pytest.fixture(scope="module")
def graph(model):
    from opsched.importers.tf_graph import from_keras

    return from_keras(model, batch=2)


@pytest.fixture(scope="module")
def machine():
    return _machine(2)


@pytest.fixture(scope="module")
def backend(machine):
    from opsched.backends.tf_cpu import TFBackend

    be = TFBackend(machine, warmup=1, repeats=2, trace_runs=1)
    yield be
    be.close()


@pytest.fixture(scope="module")
def backend1():
    """A backend for a one-core machine (its only setting: inter=1, intra=1)."""
    from opsched.backends.tf_cpu import TFBackend

    be = TFBackend(_machine(1), warmup=0, repeats=1, trace_runs=1)
    yield be
    be.close()


def check_trace(trace: Trace, graph: OpGraph, plan: Plan, machine: Machine) -> None:
    """One event per op on the plan's device and threads, dependencies and slots respected."""
    ev = trace.by_op()
    assert len(trace.events) == len(graph.ops) and set(ev) == {op.id for op in graph.ops}
    for op in graph.ops:
        e, a = ev[op.id], plan[op.id]
        assert (e.device, e.threads) == (a.device, a.threads)
        assert e.end >= e.start >= 0.0
        for p in set(graph.predecessors(op.id)) | set(a.after):
            assert e.start >= ev[p].end, f"{op.id} started before {p} ended"
    for dev in machine.devices:
        points = sorted([(e.end, 0, -e.threads) for e in trace.events if e.device == dev.id]
                        + [(e.start, 1, e.threads) for e in trace.events if e.device == dev.id])
        load = 0
        for _, _, d in points:
            load += d
            assert load <= dev.cores
    assert trace.makespan > 0 and trace.meta["wall_s"] > 0


def test_runs_plans_into_valid_traces(backend, graph, machine):
    rng = random.Random(1)
    topo = [graph.ops[i].id for i in graph.topo_index]
    mixed = {}
    for k, op_id in enumerate(topo):
        after = tuple(rng.sample(topo[:k], 1)) if k and rng.random() < 0.3 else ()
        mixed[op_id] = Assignment("cpu", rng.randint(1, 2), rng.random(), after)
    plans = [uniform_plan(graph, machine, 2, policy="all-cores"), uniform_plan(graph, machine, 1, policy="one"),
             # (its pools pinned to the one-thread plan's, to spare a worker process)
             Plan.build(graph, machine, mixed, policy="mixed", inter_op=2, intra_op=1)]
    for plan in plans:
        trace = backend.run(graph, plan)
        check_trace(trace, graph, plan, machine)
        assert trace.backend == "tf" and trace.meta["violations"] == 0
    assert trace.meta["control_deps"] > 0  # the mixed plan's slot chains and waits
    # The all-cores plan maps to TF's intra-op pool; one thread per op to co-running.
    all_cores = backend.run(graph, plans[0])
    assert (all_cores.meta["intra_op"], all_cores.meta["inter_op"]) == (2, 1)
    one = backend.settings_for(graph, plans[1])
    assert one.intra == 1 and one.inter == 2  # the three branches can co-run on two slots


def test_one_slot_runs_the_plans_priority_order(backend1, graph):
    machine1 = backend1.machine
    rng = random.Random(5)
    plan = Plan.build(graph, machine1, {op.id: Assignment("cpu", 1, float(rng.randint(0, 3))) for op in graph.ops})
    trace = backend1.run(graph, plan)
    check_trace(trace, graph, plan, machine1)
    ran = [e.op for e in sorted(trace.events, key=lambda e: (e.start, e.end))]
    # The greedy list schedule on one slot: highest-priority ready op first, ties in graph order.
    done: set[str] = set()
    expected = []
    while len(expected) < len(graph.ops):
        ready = [i for i, op in enumerate(graph.ops) if op.id not in done
                 and all(p in done for p in graph.predecessors(op.id))]
        i = min(ready, key=lambda i: (-plan[graph.ops[i].id].priority, i))
        expected.append(graph.ops[i].id)
        done.add(graph.ops[i].id)
    assert ran == expected


def test_outputs_equal_the_keras_model(backend, graph, model, machine, tf):
    x = np.random.default_rng(3).standard_normal((2, 16, 16, 3)).astype(np.float32)
    want = model(tf.constant(x), training=False).numpy()
    for plan in (uniform_plan(graph, machine, 1), uniform_plan(graph, machine, 2)):  # two settings, two orders
        (got,) = backend.execute(graph, plan, [x])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ExecutionError, match="needs shape"):
        backend.execute(graph, uniform_plan(graph, machine, 1), [x[:1]])


def test_plan_meta_sets_the_thread_pools(backend, graph, machine):
    plan = Plan.build(graph, machine, uniform_plan(graph, machine, 1).assignments, policy="pinned",
                      intra_op=2, inter_op=1)
    s = backend.settings_for(graph, plan)
    assert (s.inter, s.intra, s.source) == (1, 2, "plan.meta")
    trace = backend.run(graph, plan)
    check_trace(trace, graph, plan, machine)
    assert (trace.meta["inter_op"], trace.meta["intra_op"]) == (1, 2)
    bad = Plan.build(graph, machine, plan.assignments, intra_op=-1)
    with pytest.raises(PlanError, match="intra"):
        backend.settings_for(graph, bad)


def test_foreign_plans_and_graphs_are_refused(backend, graph, machine):
    other = OpGraph(graph.ops[:-1], tuple(e for e in graph.edges if graph.ops[-1].id not in (e.src, e.dst)),
                    name="other")
    with pytest.raises(PlanError, match="different graph"):
        backend.run(graph, uniform_plan(other, machine, 1))
    with pytest.raises(PlanError, match="different machine"):
        backend.run(graph, uniform_plan(graph, _machine(3), 1))
    plain = OpGraph((Op("a", "a"), Op("b", "b")), (Edge("a", "b"),), name="no-source")
    with pytest.raises(ExecutionError, match="has no executable source, not from TensorFlow"):
        backend.run(plain, uniform_plan(plain, machine, 1))


def test_gpu_ops_run_on_a_logical_device(graph, model, tf):
    """On a CPU-only TF, a plan's gpu:0 is a logical CPU device: placement, Send/Recv, same outputs."""
    from opsched.backends.tf_cpu import TFBackend

    m = _machine(2, gpus=1)
    ids = [graph.ops[i].id for i in graph.topo_index]
    half = set(ids[1::2])
    plan = Plan.build(graph, m, {op.id: Assignment("gpu:0" if op.id in half else "cpu", 1, 0.0)
                                 for op in graph.ops}, inter_op=2, intra_op=1)
    x = np.random.default_rng(4).standard_normal((2, 16, 16, 3)).astype(np.float32)
    be = TFBackend(m, warmup=0, repeats=1, trace_runs=1)
    try:
        trace = be.run(graph, plan)
        check_trace(trace, graph, plan, m)
        assert trace.meta["misplaced"] == {}
        assert {e.device for e in trace.events} == {"cpu", "gpu:0"}
        (got,) = be.execute(graph, plan, [x])
        np.testing.assert_allclose(got, model(tf.constant(x), training=False).numpy(), rtol=1e-4, atol=1e-6)
        pids = be.worker_pids()
        assert pids
    finally:
        be.close()
    assert not any(_alive(p) for p in pids)


def test_a_crashed_worker_is_a_clear_error_and_close_leaves_nothing(backend, graph, machine):
    plan = uniform_plan(graph, machine, 2)
    backend.run(graph, plan)
    pids = backend.worker_pids()
    assert len(pids) >= 2  # one process per setting used so far
    from opsched.backends.tf_cpu import TFSettings

    victim = backend.worker_pid(TFSettings(1, 2))  # the all-cores plan's worker, already running
    assert victim in pids
    os.kill(victim, signal.SIGKILL)  # a process this backend started
    with pytest.raises(ExecutionError, match="exited with code"):
        backend.run(graph, plan)
    backend.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(ExecutionError, match="closed"):
        backend.run(graph, plan)


def test_profile_tf_feeds_the_profile_format(graph, machine, backend1, tmp_path):
    pytest.importorskip("opsched.backends.profiler")
    from opsched.backends.tf_cpu import profile_tf
    from opsched.engine.profiles import Profile

    prof = profile_tf(graph, machine, levels=[1], runs=3, warmup=1, backend=backend1)  # reuses its worker
    assert set(prof.ops) == {op.id for op in graph.ops} and prof.levels == (1,)
    assert all(len(p.samples[1]) == 3 and min(p.samples[1]) > 0 for p in prof.ops.values())
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").graph_fingerprint == graph.fingerprint()
