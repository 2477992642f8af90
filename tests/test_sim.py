"""The discrete-event simulator (issue 3, "Simulator"): engine, SimBackend, lower_bound.

Timing values are compared with the analytic model's own predictions, so
every expected makespan below is derived by hand from the time table (no
wall-clock figure anywhere).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from opsched.backends.base import BackendBase
from opsched.backends.registry import get_backend
from opsched.backends.sim import SimBackend
from opsched.engine.models.analytic import AnalyticModel, default_model
from opsched.engine.sim import SimState, lower_bound, prepare, sequential_makespan
from opsched.errors import ExecutionError, PlanError
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import Device, Machine, get_machine
from opsched.plan import Assignment, Plan, uniform_plan


def cpu_machine(cores: int = 4, bw: float = 20.0) -> Machine:
    return Machine("test-cpu", (Device("cpu", "cpu", cores, 50.0, bw, 8.0),))


def independent(n: int, kind: str = "conv", flops: float = 4e7, nbytes: float = 1e5) -> OpGraph:
    ops = [Op(f"o{i}", f"o{i}", kind, flops * (1 + 0.1 * i), nbytes, nbytes) for i in range(n)]
    return OpGraph(tuple(ops), (), name=f"indep{n}")


def plan_of(graph: OpGraph, machine: Machine, rows: dict[str, tuple]) -> Plan:
    return Plan.build(graph, machine, {k: Assignment(*v) for k, v in rows.items()})


def random_graph(n: int, seed: int) -> OpGraph:
    rng = np.random.default_rng(seed)
    kinds = ["conv", "matmul", "elementwise", "norm", "pool"]
    ops = [Op(f"n{i}", f"n{i}", kinds[int(rng.integers(len(kinds)))], float(10 ** rng.uniform(5, 9)),
              float(10 ** rng.uniform(3, 7)), float(10 ** rng.uniform(3, 7))) for i in range(n)]
    edges = [Edge(f"n{int(j)}", f"n{i}", float(10 ** rng.uniform(3, 7)))
             for i in range(1, n) for j in rng.choice(i, size=min(i, int(rng.integers(1, 3))), replace=False)]
    return OpGraph(tuple(ops), tuple(edges), name=f"rand{n}-{seed}")


def random_plan(graph: OpGraph, machine: Machine, seed: int, after: bool = False) -> Plan:
    rng = np.random.default_rng(seed)
    asg = {}
    for k, op in enumerate(graph.ops):
        dev = machine.devices[int(rng.integers(len(machine.devices)))]
        lv = dev.thread_levels()
        deps = ()
        if after and k > 1 and rng.random() < 0.3:
            deps = (graph.ops[int(rng.integers(k))].id,)  # an earlier op: cannot deadlock
        asg[op.id] = Assignment(dev.id, int(lv[int(rng.integers(len(lv)))]), float(rng.random()), deps)
    return Plan.build(graph, machine, asg)


def check_trace(graph: OpGraph, machine: Machine, plan: Plan, trace) -> None:
    """Dependencies respected, one event per op as planned, no core double-booked."""
    ev = trace.by_op()
    assert set(ev) == {op.id for op in graph.ops}
    for op in graph.ops:
        e, a = ev[op.id], plan[op.id]
        assert (e.device, e.threads) == (a.device, a.threads)
        assert len(set(e.cores)) == a.threads
        for p in list(graph.predecessors(op.id)) + list(a.after):
            assert e.start >= ev[p].end - 1e-15
    by_core: dict[tuple[str, int], list] = {}
    for e in trace.events:
        for c in e.cores:
            by_core.setdefault((e.device, c), []).append((e.start, e.end))
    for spans in by_core.values():
        spans.sort()
        for (_, end0), (start1, _) in zip(spans, spans[1:], strict=False):
            assert start1 >= end0 - 1e-15


# ----------------------------------------------------------------- backend
def test_backend_interface_and_registry():
    m = cpu_machine()
    b = get_backend("sim", m)
    assert isinstance(b, SimBackend) and isinstance(b, BackendBase)
    assert b.name == "sim" and b.measured is False
    with SimBackend(m) as b2:
        assert b2.model is not None


def test_sequential_plan_is_the_sum_of_all_core_times():
    m = cpu_machine(4)
    g = random_graph(30, 1)
    tt = default_model().time_table(g, m)
    trace = SimBackend(m).run(g, uniform_plan(g, m, 4))
    assert trace.makespan == pytest.approx(tt.on(0, 4).sum(), rel=1e-12)
    assert sequential_makespan(g, m) == pytest.approx(trace.makespan, rel=1e-12)
    check_trace(g, m, uniform_plan(g, m, 4), trace)


def test_compute_bound_ops_co_run_without_slowdown():
    m = cpu_machine(4, bw=1e6)  # bandwidth never oversubscribed
    g = independent(4)
    tt = default_model().time_table(g, m)
    trace = SimBackend(m).run(g, uniform_plan(g, m, 1))
    assert trace.makespan == pytest.approx(tt.on(0, 1).max(), rel=1e-12)
    assert all(e.start == 0.0 for e in trace.events)


def test_interference_is_progress_based():
    """Two memory-bound ops co-run: both slow down by AnalyticModel.slowdown while
    together; once the short one ends, the long one finishes its remaining work alone."""
    m = cpu_machine(8, bw=5.0)  # 4 threads draw the whole bandwidth: two such ops oversubscribe it
    ops = (Op("a", "a", "elementwise", 0.0, 4e6, 4e6), Op("b", "b", "elementwise", 0.0, 2e7, 2e7))
    g = OpGraph(ops, (), name="pair")
    model = AnalyticModel()
    dev = m.cpu
    ta, tb = model.op_time(ops[0], dev, 4), model.op_time(ops[1], dev, 4)
    da, db = model.mem_demand(ops[0], dev, 4), model.mem_demand(ops[1], dev, 4)
    fa, fb = model.slowdown(dev, np.array([da, db]))
    assert fa > 1.0 and fb > 1.0  # the test is about interference: it must happen
    end_a = ta * fa
    end_b = end_a + (tb - end_a / fb)  # work done at rate 1/fb, the rest alone
    trace = SimBackend(m, model=model).run(g, uniform_plan(g, m, 4))
    ev = trace.by_op()
    assert ev["a"].start == ev["b"].start == 0.0
    assert ev["a"].end == pytest.approx(end_a, rel=1e-12)
    assert ev["b"].end == pytest.approx(end_b, rel=1e-12)


class HalfSpeedModel(AnalyticModel):
    """A model whose interference law is not the analytic one (exercises the generic call path)."""

    def slowdown(self, device, demands):
        return np.full(len(demands), 2.0) if len(demands) > 1 else np.ones(len(demands))


def test_custom_model_slowdown_is_used():
    m = cpu_machine(2)
    g = OpGraph((Op("a", "a", "conv", 1e8), Op("b", "b", "conv", 1e8)), (), name="twin")
    model = HalfSpeedModel()
    t = model.op_time(g.ops[0], m.cpu, 1)
    trace = SimBackend(m, model=model).run(g, uniform_plan(g, m, 1))
    assert trace.makespan == pytest.approx(2 * t, rel=1e-12)


def test_cross_device_edge_pays_the_transfer():
    m = get_machine("2x2080ti")
    g = OpGraph((Op("a", "a", "conv", 1e9, 1e6, 4e7), Op("b", "b", "conv", 1e8, 4e7, 1e6)),
                (Edge("a", "b", 4e7),), name="hop")
    plan = plan_of(g, m, {"a": ("gpu:0", 1, 2.0), "b": ("cpu", 8, 1.0)})
    model = default_model()
    trace = SimBackend(m).run(g, plan)
    ev = trace.by_op()
    xfer = model.transfer_time(4e7, "gpu:0", "cpu", m)
    assert xfer > 0
    assert ev["b"].start == pytest.approx(ev["a"].end + xfer, rel=1e-12)
    assert trace.meta["transfer_wait"]["b"] == pytest.approx(xfer, rel=1e-9)
    same = SimBackend(m).run(g, plan_of(g, m, {"a": ("gpu:0", 1, 2.0), "b": ("gpu:0", 1, 1.0)})).by_op()
    assert same["b"].start == same["a"].end  # same device: no transfer


def test_priority_order_and_graph_order_ties():
    m = cpu_machine(2)
    g = independent(4)
    rows = {"o0": ("cpu", 2, 1.0), "o1": ("cpu", 2, 3.0), "o2": ("cpu", 2, 1.0), "o3": ("cpu", 2, 2.0)}
    trace = SimBackend(m).run(g, plan_of(g, m, rows))
    order = [e.op for e in sorted(trace.events, key=lambda e: e.start)]
    assert order == ["o1", "o3", "o0", "o2"]


def test_greedy_backfill_starts_what_fits():
    """The top-priority op needs 4 slots but only 2 are free: a lower-priority
    1-thread op starts at once (each ready op that fits starts)."""
    m = cpu_machine(4)
    g = independent(3)
    rows = {"o0": ("cpu", 2, 3.0), "o1": ("cpu", 4, 2.0), "o2": ("cpu", 1, 1.0)}
    ev = SimBackend(m).run(g, plan_of(g, m, rows)).by_op()
    assert ev["o0"].start == 0.0 and ev["o2"].start == 0.0
    assert ev["o1"].start == pytest.approx(max(ev["o0"].end, ev["o2"].end))


def test_after_holds_an_independent_op():
    m = cpu_machine(4)
    g = independent(2)
    rows = {"o0": ("cpu", 1, 2.0), "o1": ("cpu", 1, 1.0, ("o0",))}
    ev = SimBackend(m).run(g, plan_of(g, m, rows)).by_op()
    assert ev["o1"].start == ev["o0"].end


def test_thread_count_between_levels_uses_the_model():
    m = cpu_machine(4)
    g = independent(1)
    trace = SimBackend(m).run(g, plan_of(g, m, {"o0": ("cpu", 3, 0.0)}))
    assert trace.makespan == pytest.approx(default_model().op_time(g.ops[0], m.cpu, 3), rel=1e-12)


@pytest.mark.parametrize("machine", ["xeon-8180-2s", "dgx1-4v100", "4xa6000"])
def test_random_plans_are_valid_schedules_above_the_lower_bound(machine):
    m = get_machine(machine)
    b = SimBackend(m)
    for seed in range(6):
        g = random_graph(40, seed)
        plan = random_plan(g, m, seed, after=seed % 2 == 1)
        trace = b.run(g, plan)
        check_trace(g, m, plan, trace)
        assert trace.makespan >= lower_bound(g, m) * (1 - 1e-12)


def test_lower_bound_definition():
    m = cpu_machine(4)
    chain = OpGraph(tuple(Op(f"c{i}", f"c{i}", "conv", 1e8) for i in range(3)),
                    (Edge("c0", "c1"), Edge("c1", "c2")), name="chain")
    tt = default_model().time_table(chain, m)
    fastest = tt.times.min(axis=(1, 2))
    assert lower_bound(chain, m) == pytest.approx(fastest.sum())  # a chain: the critical path
    wide = independent(16)
    tt = default_model().time_table(wide, m)
    work = (tt.times[:, 0, :] * np.array(m.cpu.thread_levels())).min(axis=1).sum()
    assert lower_bound(wide, m) == pytest.approx(max(tt.times.min(axis=(1, 2)).max(), work / 4))
    assert lower_bound(wide, m) == pytest.approx(work / 4)  # 16 parallel ops on 4 cores: the work bound


def test_deterministic_and_seeded_noise():
    m = get_machine("xeon-8180-2s")
    g = random_graph(30, 3)
    plan = random_plan(g, m, 3)
    a, b = SimBackend(m).run(g, plan), SimBackend(m).run(g, plan)
    assert a.events == b.events
    n1 = SimBackend(m, noise=0.2, seed=7)
    n2 = SimBackend(m, noise=0.2, seed=7)
    r1 = [n1.run(g, plan).makespan for _ in range(3)]
    assert r1 == [n2.run(g, plan).makespan for _ in range(3)]
    assert len(set(r1)) == 3 and r1[0] != a.makespan
    assert n1.run(g, plan, seed=5).events == n2.run(g, plan, seed=5).events
    with pytest.raises(ValueError, match="noise"):
        SimBackend(m, noise=-1)


def test_plan_for_another_graph_or_machine_is_refused():
    m = cpu_machine(4)
    g, other = random_graph(10, 0), random_graph(10, 1)
    with pytest.raises(PlanError, match="different graph"):
        SimBackend(m).run(other, uniform_plan(g, m, 1))
    with pytest.raises(PlanError, match="different machine"):
        SimBackend(cpu_machine(2)).run(g, uniform_plan(g, m, 1))
    bad = Plan({op.id: Assignment("gpu:3", 1) for op in g.ops})
    with pytest.raises(PlanError, match="gpu:3"):
        SimBackend(m).run(g, bad)


# ------------------------------------------------------------------- engine
def test_engine_step_api():
    m = cpu_machine(4)
    g = OpGraph((Op("a", "a", "conv", 1e8, 1e5, 2e5), Op("b", "b", "conv", 2e8, 1e5, 3e5),
                 Op("c", "c", "conv", 1e8, 1e5, 5e5)),
                (Edge("a", "c", 2e5), Edge("b", "c", 3e5)), name="join")
    st = SimState(prepare(g, m))
    assert st.ready_ops() == [0, 1] and st.now == 0.0 and not st.done
    assert not st.can_start(2, 0, 1)  # c waits for a and b
    with pytest.raises(PlanError, match="waiting for its inputs"):
        st.start(2, 0, 1)
    with pytest.raises(PlanError, match="slots"):
        st.start(0, 0, 8)
    with pytest.raises(ExecutionError, match="nothing is running"):
        st.advance()
    st.start(0, 0, 2)
    st.start(1, 0, 2)
    assert st.free_slots(0) == 0 and not st.can_start(1, 0, 1)
    assert st.mem_in_use(0) == pytest.approx(5e5)
    done = st.advance()
    assert done == [0] and st.free_slots(0) == 2 and st.ready_ops() == []
    assert st.advance() == [1] and st.ready_ops() == [2]
    assert st.mem_in_use(0) == pytest.approx(5e5)  # a and b outputs live until c finishes
    st.start(2, 0, 4)
    st.advance()
    assert st.done and st.makespan == st.now
    assert st.mem_in_use(0) == pytest.approx(5e5)  # only the graph output remains
    trace = st.trace()
    assert [e.op for e in trace.events] == ["a", "b", "c"]
    assert trace.makespan == st.makespan


def test_advance_completes_every_op_ending_at_that_time():
    m = cpu_machine(4, bw=1e6)
    g = OpGraph(tuple(Op(f"x{i}", f"x{i}", "conv", 1e8) for i in range(3)), (), name="same")
    st = SimState(prepare(g, m))
    for i in range(3):
        st.start(i, 0, 1)
    assert st.advance() == [0, 1, 2] and st.done


def test_sim_speed_bench_smoke(tmp_path):
    """The benchmark script runs end to end (figures are not asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "sim_speed.py"), "--quick", "--ops", "30", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "sim_speed.json").read_text())
    assert data["rows"] and all(math.isfinite(r["ops_per_s"]) for r in data["rows"])
    assert (tmp_path / "sim_speed.md").exists()


@pytest.mark.parametrize("machine", ["knl-68", "dgx1-4v100", "cpu:4:50:30"])
@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_makespan_without_the_trace_equals_the_traced_run(machine, noise):
    """Simulator.makespan skips building the trace: the same value and the same
    noise draws as run(...).makespan, bit for bit, for every heuristic's plan
    (holds and co-running included)."""
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    m = get_machine(machine)
    g = generate("erdos_renyi", 60, 7)
    traced, bare = SimBackend(m, noise=noise, seed=3), SimBackend(m, noise=noise, seed=3)
    for name in ("sequential", "tf-recommended", "critical-path-first", "heft", "random"):
        plan = get_policy(name).plan(g, m)
        assert bare.makespan(g, plan) == traced.run(g, plan).makespan
