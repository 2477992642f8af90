"""The moldable-task heuristics: CPA, biCPA and two-phase LP rounding make valid
plans, do what their papers say on textbook instances, and biCPA never loses to CPA."""

from __future__ import annotations

import numpy as np
import pytest
from _moldable import PerfectScaling, chain, fork
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policies import check_trace

from opsched.backends.sim import SimBackend
from opsched.engine.bounds import Allocation, AllocationLP
from opsched.engine.sim import prepare
from opsched.machine import PRESETS, Device, Machine, get_machine
from opsched.policies import get_policy, heuristic_names
from opsched.policies.cpa import cpa_allocation
from opsched.policies.lp_rounding import SETTINGS, jz_mu, ltw_mu, round_allocation
from opsched.policies.moldable import cpu_problem, longest_paths
from opsched.synthetic import GENERATORS, generate

MOLDABLE = ("cpa", "bicpa", "lp-rounding")
MACHINES = {**PRESETS, "cpu8": get_machine("cpu:8:50:10000")}


def test_registered_as_heuristics():
    for name in MOLDABLE:
        assert name in heuristic_names()
        assert get_policy(name).name == name


@pytest.mark.parametrize("machine", sorted(MACHINES))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(GENERATORS)), n_ops=st.integers(1, 50), seed=st.integers(0, 10_000))
def test_moldable_plans_are_valid_schedules_and_bicpa_never_loses_to_cpa(machine, family, n_ops, seed):
    m = MACHINES[machine]
    g = generate(family, n_ops, seed)
    sim = SimBackend(m)
    spans = {}
    for name in MOLDABLE:
        plan = get_policy(name).plan(g, m)
        plan.validate(g, m)
        assert not any(a.after for a in plan.assignments.values())  # list scheduling: no holds
        trace = sim.run(g, plan)
        check_trace(g, plan, m, trace)
        spans[name] = trace.makespan
    assert spans["bicpa"] <= spans["cpa"]


def test_cpa_gives_every_op_of_a_perfectly_scaling_chain_all_cores():
    g, m, model = chain(6), MACHINES["cpu8"], PerfectScaling()
    plan = get_policy("cpa").plan(g, m, model)
    assert {a.threads for a in plan.assignments.values()} == {8}
    # and that is the optimum: the work over the cores
    work = sum(op.flops for op in g.ops) / 50e9
    assert SimBackend(m, model).run(g, plan).makespan == pytest.approx(work / 8, rel=1e-9)


def test_cpa_allocation_stops_where_the_critical_path_meets_the_average_area():
    g, m, model = fork(6), MACHINES["cpu8"], PerfectScaling()
    problem = cpu_problem(g, m, prepare(g, m, model).table)
    alloc = cpa_allocation(problem)
    top, bottom = longest_paths(g, problem.durations(alloc))
    assert float(np.max(top + bottom)) <= problem.area(alloc) / problem.P * (1 + 1e-12)
    # with perfect scaling the area does not grow, so it is the branches' work over the cores
    assert problem.area(alloc) == pytest.approx(sum(op.flops for op in g.ops) / 50e9)
    # but not every branch got every core: the branches co-run
    assert min(problem.levels[a] for a in alloc) < 8


def test_cpa_skips_levels_that_slow_an_op_down():
    """Tiny ops on a manycore CPU: wide teams only add sync cost, so CPA keeps them narrow."""
    g, m = generate("layered", 40, 7), PRESETS["knl-68"]
    problem = cpu_problem(g, m, prepare(g, m).table)
    alloc = cpa_allocation(problem)
    for i, a in enumerate(alloc):
        assert problem.times[i, a] <= problem.times[i, 0] * (1 + 1e-12)


def test_bicpa_tries_smaller_caps_and_reports_them():
    g, m = generate("layered", 60, 11), PRESETS["xeon-8180-2s"]
    plan = get_policy("bicpa").plan(g, m)
    caps = {k for k in plan.meta["candidates"]}
    assert "cpu:P'=56" in caps and "cpu:P'=1" in caps
    assert plan.meta["chosen"] in caps
    assert SimBackend(m).run(g, plan).makespan == pytest.approx(min(plan.meta["candidates"].values()))


def test_moldable_heuristics_place_on_gpus_like_heft_or_keep_the_cpu():
    g, m = generate("matmul_chains", 20, 3), PRESETS["dgx1-4v100"]
    for name in ("cpa", "bicpa"):
        plan = get_policy(name).plan(g, m)
        assert plan.meta["chosen"].split(":")[0] in ("cpu", "heft")
        assert {k.split(":")[0] for k in plan.meta["candidates"]} == {"cpu", "heft"}
    plan = get_policy("lp-rounding").plan(g, m)
    assert {k.split(":")[0] for k in plan.meta["candidates"]} == {"lp", "cpu", "heft"}
    assert all(a.threads == 1 for a in plan.assignments.values() if a.device != "cpu")


def test_caps_of_lepere_trystram_woeginger_and_jansen_zhang():
    assert ltw_mu(68) == 26  # ceil(0.382 * 68)
    assert jz_mu(68) == 19  # about 0.27 * 68
    assert ltw_mu(1) == jz_mu(1) == 1
    for P in range(1, 200):
        assert 1 <= jz_mu(P) <= ltw_mu(P) <= P


def _lp_of(weights: dict, cand: list) -> AllocationLP:
    placement = np.zeros((1, 1))
    placement[0, 0] = 1.0
    return AllocationLP(0.0, 0.0, 0.0, (weights,), np.zeros(1), placement, "levels", "optimal", 0.0, (tuple(cand),))


def test_rounding_rule_takes_the_wider_allocation_within_rho_of_it():
    cand = [Allocation(0, 1, 8.0), Allocation(0, 2, 4.0), Allocation(0, 4, 2.0)]
    # x = 0.7 * 4 + 0.3 * 8 = 5.2: 30% of the way from the wide (4 s) to the narrow (8 s) allocation
    lp = _lp_of({(0, 2): 0.7, (0, 1): 0.3}, cand)
    assert round_allocation(lp, 0, 0.43) == (0, 2)
    assert round_allocation(lp, 0, 0.25) == (0, 1)
    # a pure allocation stays
    assert round_allocation(_lp_of({(0, 4): 1.0}, cand), 0, 0.5) == (0, 4)


def test_lp_rounding_caps_its_capped_candidates(monkeypatch):
    import opsched.policies.lp_rounding as lpr

    g, m = chain(5), PRESETS["knl-68"]
    monkeypatch.setattr(lpr, "SETTINGS", SETTINGS[:1])  # Jansen-Zhang only
    plan = get_policy("lp-rounding").plan(g, m, PerfectScaling())
    assert max(a.threads for a in plan.assignments.values()) <= jz_mu(68)


def test_busy_cores_cap_the_allocations():
    cpu = Device("cpu", "cpu", 16, 40.0, 100.0, 64.0, busy_cores=6)
    m = Machine("busy-16", (cpu,))
    g, model = chain(4), PerfectScaling()
    for name in MOLDABLE:
        plan = get_policy(name).plan(g, m, model)
        assert max(a.threads for a in plan.assignments.values()) <= 10, name


def _cpa_allocation_full_passes(problem, processors=None, cap=None):
    """CPA's allocation as the paper states it: durations, levels and area recomputed from
    scratch at every step (cpa_allocation keeps them up to date instead)."""
    from opsched.policies.cpa import next_level

    P = problem.P if processors is None else int(processors)
    cap = P if cap is None else int(cap)
    alloc = [0] * problem.n
    cpu = [problem.is_cpu(i) for i in range(problem.n)]
    if not any(cpu):
        return alloc
    nxt = [next_level(problem, i, 0, cap) if cpu[i] else None for i in range(problem.n)]
    while True:
        top, bottom = longest_paths(problem.graph, problem.durations(alloc))
        t_cp = float(np.max(top + bottom))
        if t_cp <= problem.area(alloc) / P:
            return alloc
        best, best_gain = -1, -np.inf
        for i in np.nonzero(top + bottom >= t_cp * (1.0 - 1e-12))[0]:
            b, a = nxt[i], alloc[i]
            if b is not None:
                gain = problem.times[i, a] / problem.levels[a] - problem.times[i, b] / problem.levels[b]
                if gain > best_gain:
                    best, best_gain = int(i), gain
        if best < 0:
            return alloc
        alloc[best] = nxt[best]
        nxt[best] = next_level(problem, best, alloc[best], cap)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(GENERATORS)), n=st.integers(1, 80), seed=st.integers(0, 10_000),
       machine=st.sampled_from(sorted(PRESETS)), cap=st.sampled_from([None, 4, 16]), gpu_ops=st.booleans())
def test_cpa_allocation_equals_the_allocation_from_full_passes(family, n, seed, machine, cap, gpu_ops):
    """Its running durations and area are the full passes' values: the same allocation, step for step."""
    from opsched.policies.moldable import heft_placement

    g, m = generate(family, n, seed), PRESETS[machine]
    placement = heft_placement(g, m, None) if gpu_ops else None
    problem = cpu_problem(g, m, prepare(g, m).table, placement)
    assert cpa_allocation(problem, cap=cap) == _cpa_allocation_full_passes(problem, cap=cap)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(GENERATORS)), n=st.integers(1, 80), seed=st.integers(0, 10_000),
       machine=st.sampled_from(sorted(PRESETS)), gpu_ops=st.booleans())
def test_bicpa_allocations_in_one_pass_equal_one_full_cpa_run_per_cap(family, n, seed, machine, gpu_ops):
    """cpa_allocations shares the runs' common steps and keeps the top and bottom levels up to
    date incrementally; every cap still gets exactly the paper's loop's allocation."""
    from opsched.policies.bicpa import bicpa_allocations
    from opsched.policies.moldable import heft_placement

    g, m = generate(family, n, seed), PRESETS[machine]
    placement = heft_placement(g, m, None) if gpu_ops else None
    problem = cpu_problem(g, m, prepare(g, m).table, placement)
    got = bicpa_allocations(problem)
    caps = [problem.P] + [k for k in reversed(problem.levels) if k < problem.P]
    assert [label for label, _ in got] == [f"P'={c}" for c in caps]
    for c, (_, alloc) in zip(caps, got, strict=True):
        assert alloc == _cpa_allocation_full_passes(problem, processors=c, cap=c), c


def test_bicpa_allocations_branch_off_on_a_wide_machine():
    """A graph where the caps really part ways (resnet-like chains on a 56-core Xeon): the
    one-pass allocations still equal the per-cap runs, and they differ between caps."""
    from opsched.policies.cpa import cpa_allocations

    g, m = generate("layered", 120, 3), PRESETS["xeon-8180-2s"]
    problem = cpu_problem(g, m, prepare(g, m).table)
    caps = [problem.P] + [k for k in reversed(problem.levels) if k < problem.P]
    got = cpa_allocations(problem, caps)
    assert len({tuple(a) for a in got.values()}) > 2
    for c in caps:
        assert got[c] == _cpa_allocation_full_passes(problem, processors=c, cap=c), c
