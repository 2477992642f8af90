"""The honest ceiling: the allocation LP and CP-SAT bound every simulated makespan,
the LP is never below the old bound, and CP-SAT's incumbent replays as a valid Plan."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from _moldable import PerfectScaling, chain, fork
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policies import check_trace

from opsched.backends.sim import SimBackend
from opsched.engine.bounds import _hull, allocation_lp, allocation_lp_bound, allocations, cpsat_schedule
from opsched.engine.sim import lower_bound, prepare
from opsched.errors import OpschedError
from opsched.hard import hard_machine
from opsched.machine import PRESETS, get_machine
from opsched.plan import Assignment, Plan
from opsched.policies import get_policy
from opsched.synthetic import GENERATORS, generate

MACHINES = {**PRESETS, "cpu4": get_machine("cpu:4:50:10000"), "cpu6-slow-mem": get_machine("cpu:6:40:8"),
            "busy": hard_machine("busy", 1), "slow-links": hard_machine("slow-links", 1)}
REL = 1e-9


def random_plan(graph, machine, data, all_counts: bool = False) -> Plan:
    """A plan with drawn devices, thread counts (levels, or any count) and priorities."""
    out = {}
    for op in graph.ops:
        dev = data.draw(st.sampled_from(machine.devices))
        if dev.is_gpu:
            k = 1
        elif all_counts:
            k = data.draw(st.integers(1, dev.cores))
        else:
            k = data.draw(st.sampled_from(dev.thread_levels()))
        out[op.id] = Assignment(dev.id, k, data.draw(st.floats(0, 1)))
    return Plan.build(graph, machine, out, policy="drawn")


# ----------------------------------------------------------------- the LP
@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(sorted(GENERATORS)), n_ops=st.integers(1, 30), seed=st.integers(0, 10_000),
       machine=st.sampled_from(sorted(MACHINES)), data=st.data())
def test_lp_bound_is_between_the_old_bound_and_every_simulated_makespan(family, n_ops, seed, machine, data):
    g, m = generate(family, n_ops, seed), MACHINES[machine]
    lp = allocation_lp_bound(g, m)
    old = lower_bound(g, m)
    assert lp >= old * (1 - REL)
    sim = SimBackend(m)
    plans = [random_plan(g, m, data)] + [get_policy(p).plan(g, m) for p in ("critical-path-first", "heft", "cpa")]
    for plan in plans:
        assert lp <= sim.run(g, plan).makespan * (1 + REL), plan.policy


@settings(max_examples=10, deadline=None)
@given(n_ops=st.integers(1, 20), seed=st.integers(0, 10_000),
       machine=st.sampled_from(["cpu6-slow-mem", "knl-68", "busy"]),
       data=st.data())
def test_lp_bound_over_every_thread_count_holds_for_plans_between_the_levels(n_ops, seed, machine, data):
    g, m = generate("layered", n_ops, seed), MACHINES[machine]
    lp = allocation_lp_bound(g, m, thread_counts="all")
    plan = random_plan(g, m, data, all_counts=True)
    assert lp <= SimBackend(m).run(g, plan).makespan * (1 + REL)


@pytest.mark.parametrize("machine", sorted(PRESETS))
@pytest.mark.parametrize("spec", ["layered:30:904", "erdos_renyi:40:902", "matmul_chains:30:905"])
def test_lp_bound_on_presets_below_every_heuristic(spec, machine):
    from opsched.specs import load_graph

    g, m = load_graph(spec), PRESETS[machine]
    lp = allocation_lp(g, m)
    assert lp.status == "optimal"
    assert lp.bound >= lower_bound(g, m) * (1 - REL)
    sim = SimBackend(m)
    for name in ("sequential", "tf-default", "critical-path-first", "heft", "maestro", "bicpa", "lp-rounding"):
        assert lp.bound <= sim.run(g, get_policy(name).plan(g, m)).makespan * (1 + REL), name
    # the solution is a convex combination per op
    for w in lp.weights:
        assert sum(w.values()) == pytest.approx(1.0, abs=1e-6)
    assert np.allclose(lp.placement.sum(axis=1), 1.0, atol=1e-6)


def test_lp_is_tighter_than_the_old_bound_where_wide_teams_cost_work():
    """On a manycore CPU the old bound takes each op's fastest time on the path
    and its cheapest work at once; the LP must pay for both with one allocation."""
    from opsched.specs import load_graph

    g, m = load_graph("layered:30:904"), PRESETS["knl-68"]
    assert allocation_lp_bound(g, m) > 1.05 * lower_bound(g, m)


def test_lp_on_a_perfectly_scaling_chain_is_the_work_over_the_cores():
    g, m, model = chain(5), get_machine("cpu:8:50:10000"), PerfectScaling()
    t1 = sum(op.flops for op in g.ops) / (50e9)
    assert allocation_lp_bound(g, m, model) == pytest.approx(t1 / 8, rel=1e-5)
    lp = allocation_lp(g, m, model)
    assert all(w == pytest.approx({(0, 8): 1.0}) for w in lp.weights)


def test_lp_with_a_fixed_placement_charges_the_exact_transfers():
    g, m = fork(4), PRESETS["dgx1-4v100"]
    everything_on_gpu0 = {op.id: "gpu:0" for op in g.ops}
    spread = {**everything_on_gpu0, "b1": "gpu:1", "b2": "gpu:2"}
    a = allocation_lp(g, m, placement=everything_on_gpu0)
    b = allocation_lp(g, m, placement=spread)
    assert all(np.argmax(p) == 1 for p in a.placement)
    # spreading does not beat the one-GPU plan by more than the branches' own time, and pays the links
    assert b.lp_makespan > 0 and a.lp_makespan > 0


def test_hull_keeps_the_lower_left_convex_front():
    # (time, work): (4, 4) and (2.5, 7) are dominated (slower and more work than another point);
    # (3, 3.9) lies below the segment from (2, 4) to (4, 4), so it stays
    pts = [(1.0, 8.0, 0), (2.0, 4.0, 1), (3.0, 3.9, 2), (4.0, 4.0, 3), (2.5, 7.0, 4)]
    assert _hull(pts) == [0, 1, 2]
    # a point on the segment between two others is not needed
    assert _hull([(1.0, 4.0, 0), (2.0, 3.0, 1), (3.0, 2.0, 2)]) == [0, 2]


def test_allocations_cover_levels_or_every_count():
    g, m = chain(2), get_machine("cpu:6:40:8")
    s = prepare(g, m)
    assert [a.threads for a in allocations(s)[0]] == list(m.cpu.thread_levels())
    assert [a.threads for a in allocations(s, "all")[0]] == list(range(1, 7))
    with pytest.raises(ValueError, match="thread_counts"):
        allocations(s, "some")


# --------------------------------------------------------------- CP-SAT
needs_ortools = pytest.mark.skipif(importlib.util.find_spec("ortools") is None,
                                   reason="needs OR-Tools (pip install -e '.[bench]')")


@needs_ortools
def test_cpsat_proves_small_graphs_optimal_and_its_plan_replays():
    g, m = generate("layered", 10, 950), MACHINES["cpu4"]
    res = cpsat_schedule(g, m, time_limit_s=20)
    assert res.optimal and res.status == "OPTIMAL"
    assert res.plan is not None
    res.plan.validate(g, m)
    sim = SimBackend(m)
    trace = sim.run(g, res.plan)
    check_trace(g, res.plan, m, trace)
    assert trace.makespan == pytest.approx(res.makespan_s)
    assert res.lower_bound_s <= res.cp_makespan_s * (1 + REL)
    for name in ("sequential", "tf-default", "critical-path-first", "heft", "cpa", "bicpa", "lp-rounding"):
        assert res.lower_bound_s <= sim.run(g, get_policy(name).plan(g, m)).makespan * (1 + REL), name


@needs_ortools
@settings(max_examples=6, deadline=None)
@given(family=st.sampled_from(["layered", "erdos_renyi", "matmul_chains"]), n_ops=st.integers(2, 10),
       seed=st.integers(0, 1000), machine=st.sampled_from(["cpu4", "xeon-8180-2s", "2x2080ti", "busy"]),
       data=st.data())
def test_cpsat_bound_is_below_every_simulated_makespan(family, n_ops, seed, machine, data):
    g, m = generate(family, n_ops, seed), MACHINES[machine]
    res = cpsat_schedule(g, m, time_limit_s=2)
    assert res.lower_bound_s >= lower_bound(g, m) * (1 - REL)
    sim = SimBackend(m)
    for plan in (random_plan(g, m, data), get_policy("heft").plan(g, m), res.plan):
        assert res.lower_bound_s <= sim.run(g, plan).makespan * (1 + REL)


@needs_ortools
def test_cpsat_gives_a_perfectly_scaling_chain_every_core():
    g, m, model = chain(4), get_machine("cpu:8:50:10000"), PerfectScaling()
    res = cpsat_schedule(g, m, model, time_limit_s=10)
    assert res.optimal
    assert {a.threads for a in res.plan.assignments.values()} == {8}


@needs_ortools
def test_cpsat_with_a_hint_is_never_worse_than_the_hint_in_its_own_terms():
    g, m = generate("erdos_renyi", 25, 951), MACHINES["cpu4"]
    hint = get_policy("critical-path-first").plan(g, m)
    res = cpsat_schedule(g, m, time_limit_s=1, hint=hint, lower_bound=allocation_lp_bound(g, m))
    assert res.cp_makespan_s <= SimBackend(m).run(g, hint).makespan * (1 + 1e-6)


@needs_ortools
def test_cpsat_policy_is_never_slower_than_the_best_heuristic():
    from opsched.policies.hints import best_heuristic

    g, m = generate("layered", 14, 3), PRESETS["xeon-8180-2s"]
    plan = get_policy("cpsat", time_limit_s=2).plan(g, m)
    assert plan.policy == "cpsat" and "lower_bound_s" in plan.meta
    assert SimBackend(m).run(g, plan).makespan <= best_heuristic(g, m)[2] * (1 + REL)


@needs_ortools
def test_cpsat_refuses_big_graphs_and_missing_ortools(monkeypatch):
    g, m = generate("layered", 30, 1), MACHINES["cpu4"]
    with pytest.raises(OpschedError, match="max_ops"):
        cpsat_schedule(g, m, time_limit_s=1, max_ops=20)
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(OpschedError, match="OR-Tools"):
        cpsat_schedule(g, m, time_limit_s=1)


def test_one_solver_process_serves_many_problems_and_restarts_after_a_crash():
    """CpSatServer: the same answers as a process per problem, through one
    process; a killed solver process is started again on the next call."""
    pytest.importorskip("ortools")
    from opsched.engine.bounds import CpSatServer, cpsat_schedule
    from opsched.synthetic import generate

    server = CpSatServer()
    try:
        for seed in (1, 2):
            g, m = generate("layered", 6, seed), get_machine("cpu:4:50:30")
            mine = cpsat_schedule(g, m, time_limit_s=5, solver=server)
            alone = cpsat_schedule(g, m, time_limit_s=5)
            assert mine.optimal and alone.optimal and mine.cp_makespan_s == alone.cp_makespan_s
        first = server._proc
        first.kill()
        first.wait()
        again = cpsat_schedule(generate("layered", 6, 3), get_machine("cpu:4:50:30"), time_limit_s=5, solver=server)
        assert again.optimal and server._proc is not first
    finally:
        server.close()
    assert server._proc is None
