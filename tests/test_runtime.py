"""Runtime models (``opsched.engine.models.runtime``) and their fit
(``opsched.backends.runtime_fit``): plan generation, the metrics, the fit, the
store.  No measurement and no wall-clock figure: "measured" makespans here
are simulations with a known runtime model.
"""

from __future__ import annotations

import numpy as np
import pytest

import opsched.backends.runtime_fit as S
from opsched.backends.sim import SimBackend
from opsched.engine.models.analytic import AnalyticModel
from opsched.engine.models.runtime import PlanningModel, TorchCPURuntime, cold_weight_bytes
from opsched.engine.profiles import ProfileError
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import Device, Machine
from opsched.plan import Assignment, Plan
from opsched.synthetic import generate
from opsched.trace import Trace, TraceEvent

MACHINE = Machine("two-core", (Device("cpu", "cpu", 2, 50.0, 20.0, 8.0),))
MODEL = AnalyticModel()


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return generate("layered", 40, 1)


@pytest.fixture(scope="module")
def plans(graph: OpGraph) -> dict[str, Plan]:
    return S.make_plans(graph, MACHINE, MODEL, n_plans=22)


def test_make_plans_gives_at_least_twenty_distinct_valid_plans(graph, plans) -> None:
    assert len(plans) >= 22
    assigns = [p.assignments for p in plans.values()]
    assert all(a != b for i, a in enumerate(assigns) for b in assigns[i + 1:])
    for name, p in plans.items():
        p.validate(graph, MACHINE)
        assert p.policy == name
    for name in ("seq-1t", "seq-all", "seq-by-kind", "corun-1t-topo", "corun-1t-cpf", "heft",
                 "critical-path-first", "mixed-by-size"):
        assert name in plans
    assert {a.threads for a in plans["seq-1t"].assignments.values()} == {1}
    assert {a.threads for a in plans["seq-all"].assignments.values()} == {2}


def test_chains_never_co_run_and_executor_plans_do(graph, plans) -> None:
    sim = SimBackend(MACHINE, MODEL)
    traces = {name: sim.run(graph, p) for name, p in plans.items()}
    for name in ("seq-1t", "seq-all", "seq-by-kind", "seq-by-size", "seq-rand-threads-0"):
        assert S.never_coruns(traces[name]), name
    assert not S.never_coruns(traces["corun-1t-topo"])
    # a chain's simulated makespan is the sum of its ops' times
    table = MODEL.time_table(graph, MACHINE)
    assert traces["seq-1t"].makespan == pytest.approx(table.on(0, 1).sum())


def test_never_coruns_on_hand_made_traces() -> None:
    def tr(*spans):
        return Trace(tuple(TraceEvent(f"o{i}", a, b, "cpu", 1) for i, (a, b) in enumerate(spans)))

    assert S.never_coruns(tr((0, 1), (1, 2), (2.5, 3)))
    assert not S.never_coruns(tr((0, 2), (1, 3)))
    assert not S.never_coruns(tr((0, 5), (1, 2), (3, 4)))


def test_metrics() -> None:
    assert S.ape([1.1, 0.9], [1.0, 1.0]) == pytest.approx([0.1, 0.1])
    s = S.scores([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert s["mdape"] == 0.0 and s["spearman"] == pytest.approx(1.0) and s["within_15"] == 1.0
    assert S.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(S.spearman([1, 1, 1], [1, 2, 3]))
    assert S.scores([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])["median_ratio"] == pytest.approx(2.0)


def _pair(t_us: float) -> OpGraph:
    """Two independent ops of ``t_us`` each (analytic model: compute-bound convolutions)."""
    flops = t_us * 1e-6 * 50e9 * 0.55
    ops = tuple(Op(f"o{i}", f"o{i}", "conv", flops, 1e3, 1e3, 0.0, (1, 8)) for i in range(2))
    return OpGraph(ops, (), name=f"pair{t_us}")


def test_calibrated_model_adds_overhead_and_serialises_small_ops_on_the_gil() -> None:
    one_thread = {"o0": Assignment("cpu", 1, 1.0), "o1": Assignment("cpu", 1, 0.0)}
    cal = TorchCPURuntime(op_overhead_s=2e-6, host_s=20e-6, corun_c0=0.0)
    model = PlanningModel(MODEL, cal)
    cpu = MACHINE.cpu
    for g in (_pair(5.0), _pair(2000.0)):
        op = g.ops[0]
        assert model.op_time(op, cpu, 1) == pytest.approx(MODEL.op_time(op, cpu, 1) + 2e-6)
        assert model.time_table(g, MACHINE).times[0, 0, 0] == pytest.approx(model.op_time(op, cpu, 1))
    small, big = _pair(5.0), _pair(2000.0)
    t_small = model.op_time(small.ops[0], cpu, 1)
    t_big = model.op_time(big.ops[0], cpu, 1)
    sim = SimBackend(MACHINE, model)
    assert t_small < 20e-6 < t_big / 50
    # two ops whose host time is their whole time take turns: as long as one after the other
    ms = sim.run(small, Plan.build(small, MACHINE, one_thread)).makespan
    assert ms == pytest.approx(2 * t_small, rel=1e-6)
    # long kernels release the GIL: they co-run at full speed (the analytic model sees no contention)
    ms = sim.run(big, Plan.build(big, MACHINE, one_thread)).makespan
    assert ms == pytest.approx(t_big, rel=1e-3)
    # the flat co-run term slows both
    flat = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(corun_c0=0.25)))
    assert flat.run(big, Plan.build(big, MACHINE, one_thread)).makespan == pytest.approx(
        1.25 * MODEL.op_time(big.ops[0], cpu, 1), rel=1e-6)


def test_team_wake_cost_is_paid_by_parallel_ops_after_an_idle_team() -> None:
    ops = tuple(Op(f"o{i}", f"o{i}", "conv", 1e7, 1e4, 1e4, 0.0, (1, 8)) for i in range(6))
    ops += (Op("o6", "o6", "elementwise", 0.0, 1e3, 1e3, 0.0, (1, 8)),  # below the grain size: no team
            Op("o7", "o7", "conv", 1e7, 1e4, 1e4, 0.0, (1, 8)))
    chain = OpGraph(ops, tuple(Edge(f"o{i}", f"o{i + 1}") for i in range(7)), name="chain8")
    threads = [1, 1, 2, 2, 1, 2, 2, 2]  # the team is woken by o2 and o5; o6 runs no parallel region
    plan = Plan.build(chain, MACHINE, {f"o{i}": Assignment("cpu", k, 0.0) for i, k in enumerate(threads)})
    model = PlanningModel(MODEL, TorchCPURuntime(thread_switch_s=1e-4))
    base = sum(MODEL.op_time(op, MACHINE.cpu, k) for op, k in zip(ops, threads, strict=True))
    trace = SimBackend(MACHINE, model).run(chain, plan)
    assert trace.makespan == pytest.approx(base + 2e-4)
    assert S.team_wakes(chain, trace) == 2
    # without the term the simulator prices nothing extra
    assert SimBackend(MACHINE, MODEL).run(chain, plan).makespan == pytest.approx(base)


def test_openmp_throttle_only_when_two_multi_threaded_ops_run_at_once() -> None:
    """The runtime runs every multi-threaded op on the calling thread (one
    OpenMP team) unless one is already running there.  ``a`` fans out to ``b``
    and ``c``: one-thread ``b`` / ``c`` beside each other, or 2-thread ops one
    at a time, keep one team (no throttle); on 4 cores, 2-thread ``b`` and
    ``c`` side by side need a second team, and every 2-thread op from then on
    (``b``, ``c`` and ``d``, not ``a`` before them: the runtime retires the
    second team's worker when a run ends) is priced ``max(t(2), t(1)) + team``."""
    def conv(i: str, flops: float) -> Op:
        return Op(i, i, "conv", flops, 1e4, 1e4, 0.0, (1, 8))

    ops = (conv("a", 2e8), conv("b", 1e8), conv("c", 1e8), conv("d", 2e8))
    g = OpGraph(ops, (Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d")), name="fan")
    model = PlanningModel(MODEL, TorchCPURuntime(team_overhead_s=5e-5))

    def plan(machine: Machine, k_bc: int) -> Plan:
        return Plan.build(g, machine, {"a": Assignment("cpu", 2, 4.0), "b": Assignment("cpu", k_bc, 3.0),
                                       "c": Assignment("cpu", k_bc, 2.0), "d": Assignment("cpu", 2, 1.0)})

    for machine, k_bc in ((MACHINE, 1), (MACHINE, 2)):  # 2 cores: at most one 2-thread op at a time
        tr = SimBackend(machine, model).run(g, plan(machine, k_bc))
        assert "omp_throttled" not in tr.meta
        assert tr.makespan == pytest.approx(SimBackend(machine, MODEL).run(g, plan(machine, k_bc)).makespan)
    four = Machine("four-core", (Device("cpu", "cpu", 4, 50.0, 20.0, 8.0),))
    cpu = four.cpu
    t = {op.id: (MODEL.op_time(op, cpu, 1), MODEL.op_time(op, cpu, 2)) for op in ops}
    assert t["a"][1] < t["a"][0]
    tr = SimBackend(four, model).run(g, plan(four, 2))
    assert tr.meta.get("omp_throttled") is True
    assert tr.makespan == pytest.approx(t["a"][1] + t["b"][0] + t["d"][0] + 2 * 5e-5, rel=1e-6)
    assert "omp_throttled" not in SimBackend(four, model).run(g, plan(four, 1)).meta


def test_handoff_latency_where_a_dependency_crosses_between_caller_and_workers() -> None:
    """The runtime's calling thread runs multi-threaded ops, workers one-thread
    ops; an op started by the other kind of thread waits for it to wake.  In the
    chain o0(1t) -> o1(2t) -> o2(2t) -> o3(1t) -> o4(1t): the caller hands o0 to a
    worker, the worker hands o1 to the caller, the caller keeps o2, hands o3 to a
    worker, which keeps o4 and, ending the run, wakes the caller once more."""
    ops = tuple(Op(f"o{i}", f"o{i}", "conv", 1e7, 1e4, 1e4, 0.0, (1, 8)) for i in range(5))
    chain = OpGraph(ops, tuple(Edge(f"o{i}", f"o{i + 1}") for i in range(4)), name="chain5")
    threads = [1, 2, 2, 1, 1]
    plan = Plan.build(chain, MACHINE, {f"o{i}": Assignment("cpu", k, 0.0) for i, k in enumerate(threads)})
    h = 1e-3
    model = PlanningModel(MODEL, TorchCPURuntime(handoff_s=h))
    trace = SimBackend(MACHINE, model).run(chain, plan)
    assert trace.meta["handoff_wait"] == {"o0": h, "o1": h, "o3": h}
    assert trace.meta["wake_end_s"] == h
    assert "transfer_wait" not in trace.meta
    ev = trace.by_op()
    assert ev["o2"].start == pytest.approx(ev["o1"].end)  # kept by the thread that finished o1
    assert ev["o3"].start == pytest.approx(ev["o2"].end + h)
    plain = SimBackend(MACHINE, MODEL).run(chain, plan)
    assert trace.makespan == pytest.approx(plain.makespan + 3 * h)
    assert S.simulate(chain, MACHINE, model, {"p": plan})["p"] == pytest.approx(plain.makespan + 4 * h)
    # every op on the calling thread (an inline run): no hand-off at all
    inline = Plan.build(chain, MACHINE, {f"o{i}": Assignment("cpu", 2, 0.0) for i in range(5)})
    tr = SimBackend(MACHINE, model).run(chain, inline)
    assert tr.meta["handoff_wait"] == {} and tr.meta["wake_end_s"] == 0.0
    assert tr.makespan == pytest.approx(SimBackend(MACHINE, MODEL).run(chain, inline).makespan)
    # a plain model keeps the simulator's semantics: no hand-off fields
    assert "handoff_wait" not in plain.meta and "wake_end_s" not in plain.meta


def test_handoff_when_one_thread_ops_fan_out_to_two_workers() -> None:
    """a(1t) -> b, c (1t, co-running): the worker that ran ``a`` keeps ``b`` (higher
    priority), ``c`` goes to a second, sleeping worker."""
    ops = tuple(Op(i, i, "conv", 1e7, 1e4, 1e4, 0.0, (1, 8)) for i in "abc")
    g = OpGraph(ops, (Edge("a", "b"), Edge("a", "c")), name="fan3")
    plan = Plan.build(g, MACHINE, {"a": Assignment("cpu", 1, 3.0), "b": Assignment("cpu", 1, 2.0),
                                   "c": Assignment("cpu", 1, 1.0)})
    tr = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(handoff_s=5e-4))).run(g, plan)
    assert set(tr.meta["handoff_wait"]) == {"a", "c"}


def _spin_graph(mid: bool) -> tuple[OpGraph, Plan]:
    """a (2 threads) [-> m (2 threads)] -> b, c (one thread each, co-running) on 2 cores."""
    def conv(i: str, flops: float) -> Op:
        return Op(i, i, "conv", flops, 1e4, 1e4, 0.0, (1, 8))

    names = ["a", "m", "b", "c"] if mid else ["a", "b", "c"]
    ops = tuple(conv(i, 2e7) for i in names)
    first = "m" if mid else "a"
    edges = ((Edge("a", "m"),) if mid else ()) + (Edge(first, "b"), Edge(first, "c"))
    g = OpGraph(ops, edges, name=f"spin{len(ops)}")
    asg = {i: Assignment("cpu", 2 if i in "am" else 1, float(len(names) - j)) for j, i in enumerate(names)}
    return g, Plan.build(g, MACHINE, asg)


def test_openmp_spin_window_slows_one_thread_ops_co_running_right_after_a_parallel_op() -> None:
    """After a 2-thread op the team's helper spins on one of the 2 cores for
    ``spin_s``: ``b`` and ``c`` co-running inside that window share the other
    core (half speed each); after it, full speed again."""
    g, plan = _spin_graph(mid=False)
    cpu = MACHINE.cpu
    ta, tb = MODEL.op_time(g.ops[0], cpu, 2), MODEL.op_time(g.ops[1], cpu, 1)
    plain = SimBackend(MACHINE, MODEL).run(g, plan)
    assert plain.makespan == pytest.approx(ta + tb)
    # a window longer than b and c: they take turns on one core all along
    long = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(spin_s=10 * tb))).run(g, plan)
    assert long.makespan == pytest.approx(ta + 2 * tb)
    # a window of w < tb: half speed for w, then full speed: b and c end w / 2 later than without
    w = tb / 2
    part = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(spin_s=w))).run(g, plan)
    assert part.makespan == pytest.approx(ta + tb + w / 2)
    ev = part.by_op()
    assert ev["b"].start == pytest.approx(ta) and ev["c"].start == pytest.approx(ta)
    # the same two ops with the window over before they start (a one-thread op first): no slowdown
    gs = OpGraph(g.ops + (Op("z", "z", "conv", 2e7 * 3, 1e4, 1e4, 0.0, (1, 8)),),
                 (Edge("a", "z"), Edge("z", "b"), Edge("z", "c")), name="spin-late")
    late = Plan.build(gs, MACHINE, {**plan.assignments, "z": Assignment("cpu", 1, 9.0)})
    tz = MODEL.op_time(gs.ops[-1], cpu, 1)
    assert tz > w
    tr = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(spin_s=w))).run(gs, late)
    assert tr.makespan == pytest.approx(ta + tz + tb)


def test_openmp_spin_alone_and_restarted_by_the_next_parallel_region() -> None:
    cpu = MACHINE.cpu
    # one one-thread op after a 2-thread op runs at full speed (the other core is free)
    ops = tuple(Op(i, i, "conv", 2e7, 1e4, 1e4, 0.0, (1, 8)) for i in "ab")
    g = OpGraph(ops, (Edge("a", "b"),), name="spin-one")
    plan = Plan.build(g, MACHINE, {"a": Assignment("cpu", 2, 1.0), "b": Assignment("cpu", 1, 0.0)})
    spin = PlanningModel(MODEL, TorchCPURuntime(spin_s=1.0))
    assert SimBackend(MACHINE, spin).run(g, plan).makespan == pytest.approx(
        SimBackend(MACHINE, MODEL).run(g, plan).makespan)
    # a -> m (both 2 threads) -> b, c: m's parallel region ends a's window, and its own starts at its end
    g, plan = _spin_graph(mid=True)
    ta, tm, tb = (MODEL.op_time(g.ops[0], cpu, 2), MODEL.op_time(g.ops[1], cpu, 2),
                  MODEL.op_time(g.ops[2], cpu, 1))
    w = tb / 2
    assert w < tm  # a window counted from a's end would be over before b and c start
    tr = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime(spin_s=w))).run(g, plan)
    assert tr.makespan == pytest.approx(ta + tm + tb + w / 2)


def test_openmp_spin_off_for_plain_models_and_with_several_teams() -> None:
    g, plan = _spin_graph(mid=False)
    plain = SimBackend(MACHINE, MODEL).run(g, plan)
    neutral = SimBackend(MACHINE, PlanningModel(MODEL, TorchCPURuntime())).run(g, plan)
    assert neutral.events == plain.events and "omp_throttled" not in plain.meta
    # 4 cores, two 2-thread ops side by side: two OpenMP teams, libgomp stops spinning - no window
    four = Machine("four-core", (Device("cpu", "cpu", 4, 50.0, 20.0, 8.0),))
    ops = tuple(Op(i, i, "conv", 2e7, 1e4, 1e4, 0.0, (1, 8)) for i in "xyuvst")
    fan = OpGraph(ops, (Edge("x", "u"), Edge("x", "v"), Edge("y", "s"), Edge("y", "t")), name="two-teams")
    asg = {i: Assignment("cpu", 2 if i in "xy" else 1, float(9 - j)) for j, i in enumerate("xyuvst")}
    p4 = Plan.build(fan, four, asg)
    tr = SimBackend(four, PlanningModel(MODEL, TorchCPURuntime(spin_s=1.0))).run(fan, p4)
    assert tr.meta.get("omp_throttled") is True
    assert tr.makespan == pytest.approx(SimBackend(four, MODEL).run(fan, p4).makespan)


def test_size_dependent_insitu_term_and_additive_streams() -> None:
    op_small = Op("s", "s", "elementwise", 1e3, 1e4, 1e4, 0.0, (1, 8))
    cpu = MACHINE.cpu
    t = MODEL.op_time(op_small, cpu, 1)
    flat = PlanningModel(MODEL, TorchCPURuntime(insitu_factor=1.5))
    sized = PlanningModel(MODEL, TorchCPURuntime(insitu_factor=1.5, insitu_exp=-0.2))
    assert flat.op_time(op_small, cpu, 1) == pytest.approx(1.5 * t)
    assert sized.op_time(op_small, cpu, 1) == pytest.approx(1.5 * t * (t / 1e-4) ** -0.2)
    add = PlanningModel(MODEL, TorchCPURuntime(act_byte_s=1e-10, stream_overlap=0.0))
    roof = PlanningModel(MODEL, TorchCPURuntime(act_byte_s=1e-10))
    stream = 1e-10 * op_small.bytes_total
    assert add.op_time(op_small, cpu, 1) == pytest.approx(t + stream)
    assert roof.op_time(op_small, cpu, 1) == pytest.approx(max(t, stream))


def test_old_calibration_files_load_with_neutral_new_fields(tmp_path) -> None:
    (tmp_path / "old.json").write_text('{"op_overhead_s": 7e-06, "host_s": 6.4e-05, "corun_c0": 0.4, '
                                       '"insitu_factor": 1.04, "thread_switch_s": 0.00011, "team_overhead_s": 0.0, '
                                       '"cold_byte_s": 7.8e-11, "act_byte_s": 2.7e-11, "fitted_on": ["a"]}')
    cal = TorchCPURuntime.load(tmp_path / "old.json")
    assert cal.handoff_s == 0.0 and cal.insitu_exp == 0.0 and cal.stream_overlap == 1.0 and cal.spin_s == 0.0
    assert cal.thread_switch_s == 0.00011
    assert PlanningModel(MODEL, cal).runtime.spin_s == 0.0
    new = TorchCPURuntime(handoff_s=4e-5, insitu_exp=-0.15, stream_overlap=0.0, spin_s=8.4e-3)
    new.save(tmp_path / "new.json")
    assert TorchCPURuntime.load(tmp_path / "new.json") == new
    assert TorchCPURuntime.load(tmp_path / "new.json").to_dict()["spin_s"] == 8.4e-3
    (tmp_path / "bad.json").write_text('{"stream_overlap": 2}')
    with pytest.raises(ProfileError, match="stream_overlap"):
        TorchCPURuntime.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text('{"spin_s": -0.001}')
    with pytest.raises(ProfileError, match="spin_s"):
        TorchCPURuntime.load(tmp_path / "bad.json")


def test_runtime_calibration_round_trips_and_rejects_bad_files(tmp_path) -> None:
    cal = TorchCPURuntime(3e-6, 4e-6, 0.1, insitu_factor=1.3, thread_switch_s=2e-5, fitted_on=("a", "b"))
    cal.save(tmp_path / "c.json")
    assert TorchCPURuntime.load(tmp_path / "c.json") == cal
    (tmp_path / "bad.json").write_text('{"op_overhead_s": -1}')
    with pytest.raises(ProfileError, match="op_overhead_s"):
        TorchCPURuntime.load(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="no such"):
        TorchCPURuntime.load(tmp_path / "missing.json")


def _fake_run(name: str, graph: OpGraph, plans: dict[str, Plan], truth: TorchCPURuntime) -> S.RuntimeRun:
    """A ModelRun whose 'measurements' are simulations with the ``truth`` calibration."""
    sim = SimBackend(MACHINE, MODEL)
    traces = {k: sim.run(graph, p) for k, p in plans.items()}
    real_sim = SimBackend(MACHINE, PlanningModel(MODEL, truth))
    real = {k: real_sim.run(graph, p) for k, p in plans.items()}
    serial = {k: S.never_coruns(t) for k, t in traces.items()}
    detail = [k for k in S.DETAIL_PLANS if k in plans]
    return S.RuntimeRun(name, graph, plans, {k: t.makespan for k, t in traces.items()}, serial,
                      {k: S.team_wakes(graph, t) if serial[k] else 0 for k, t in traces.items()},
                      cold_weight_bytes(graph),
                      np.array([max(0.0, op.bytes_total - op.param_bytes) for op in graph.ops]),
                      {k: S._op_times(graph, traces[k]) for k in detail},
                      {k: S._op_times(graph, real[k]) for k in detail},
                      {k: [t.makespan * f for f in (0.99, 1.0, 1.01)] for k, t in real.items()},
                      {k: [t.makespan] * 3 for k, t in real.items()},
                      {k: [0.0] * 3 for k in real})


def test_calibration_fit_recovers_a_known_runtime_and_is_left_out(graph, plans, tmp_path) -> None:
    # memory streams slow enough that some ops wait for them and others hide them (the roofline's two sides)
    truth = TorchCPURuntime(op_overhead_s=60e-6, host_s=8e-6, corun_c0=0.1, insitu_factor=1.2,
                               thread_switch_s=150e-6, cold_byte_s=1e-9, act_byte_s=2e-10, spin_s=2e-3)
    g2 = generate("erdos_renyi", 30, 2)
    runs = [_fake_run("a", graph, plans, truth), _fake_run("b", g2, S.make_plans(g2, MACHINE, MODEL, 20), truth)]
    cal = S.fit_runtime(runs, MACHINE, MODEL)
    assert cal.op_overhead_s == pytest.approx(60e-6, rel=0.1)
    assert cal.insitu_factor == pytest.approx(1.2, rel=0.05)
    # with the spin window, the second hand-off pass may take the grid's smallest step (10 us) where the
    # truth has none (it trades with the unidentifiable host time); the team wake-up cost gives way a little
    assert cal.handoff_s <= 10e-6
    assert cal.thread_switch_s == pytest.approx(150e-6, rel=0.25)
    assert cal.cold_byte_s == pytest.approx(1e-9, rel=0.1)
    assert cal.act_byte_s == pytest.approx(2e-10, rel=0.1)
    assert cal.spin_s == 2e-3  # a grid point, told apart by the mixed plans
    assert cal.corun_c0 == 0.1  # (the host time is not identifiable on these large ops: any fit within 1%)
    fit = S.simulate(graph, MACHINE, PlanningModel(MODEL, cal), plans)
    assert all(abs(fit[k] / runs[0].measured(k) - 1) < 0.01 for k in plans)
    assert cal.fitted_on == ("a", "b")


def test_graph_edges_unused_guard() -> None:
    # make_plans works on a graph with a single chain (no parallelism): co-run plans equal chains
    ops = tuple(Op(f"o{i}", f"o{i}", "matmul", 1e6, 1e4, 1e4, 0.0, (1, 16)) for i in range(25))
    chain = OpGraph(ops, tuple(Edge(f"o{i}", f"o{i + 1}") for i in range(24)), name="chain")
    ps = S.make_plans(chain, MACHINE, MODEL, n_plans=20)
    assert len(ps) >= 20


def test_measurements_are_stored_beside_the_profiles_and_refit_from_there(graph, plans, tmp_path) -> None:
    """What `opsched profile` stores is what the refit reads: the graph (with its
    cold weight bytes), the plans and the measurements; a torn record is skipped."""
    truth = TorchCPURuntime(op_overhead_s=30e-6, insitu_factor=1.1)
    fake = _fake_run("a", graph, plans, truth)
    measured = {"walls": fake.walls, "busy": fake.busy, "others": fake.others,
                "op_durations": {p: {op.id: float(t) for op, t in zip(graph.ops, fake.op_measured[p])}
                                 for p in fake.op_measured}}
    path = S.save_record(graph, S.GraphRef("layered:40:1"), MACHINE, plans, measured, {"rounds": 3},
                         cache_dir=tmp_path)
    assert path.parent == S.runtime_dir(MACHINE, tmp_path) and path.is_file()
    (path.parent / "torch-cpu_torn.json").write_text("{")
    with pytest.warns(UserWarning, match="skipping runtime measurements"):
        runs = S.load_runs(MACHINE, MODEL, cache_dir=tmp_path)
    assert len(runs) == 1 and runs[0].graph.fingerprint() == graph.fingerprint()
    np.testing.assert_allclose(runs[0].cold, cold_weight_bytes(graph))
    assert runs[0].walls == fake.walls and set(runs[0].op_measured) == set(fake.op_measured)
    fitted = S.fit_runtime(runs, MACHINE, MODEL)
    assert fitted.op_overhead_s == pytest.approx(30e-6, rel=0.15) and fitted.fitted_on == (graph.name,)
    fitted.save(S.runtime_path(MACHINE, "torch-cpu", tmp_path))
    assert S.load_runtime(MACHINE, "torch-cpu", tmp_path) == fitted
    assert S.load_runtime(MACHINE, "tf", tmp_path) is None
