"""The plan-time search's budget: a small graph spends its spare planning time, a big one plans as before."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.backends.sim import SimBackend
from opsched.machine import get_machine
from opsched.policies import load
from opsched.policies.budget import (
    BICPA_COST,
    BUDGET_EXTRA,
    BUDGET_FREE_EXTRA,
    COARSE_STEPS,
    LARGE_EXTRA,
    LP_COST,
    MAX_STEPS,
    search_budget,
)
from opsched.policies.exported import pretrained_path
from opsched.synthetic import generate


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), gpu=st.booleans(), refine=st.integers(0, 50), fill=st.floats(0.0, 1.0),
       budget_ops=st.sampled_from([0, 50, 200]))
def test_the_budget_only_adds_and_only_below_the_budget_graph(n, gpu, refine, fill, budget_ops):
    b = search_budget(n, gpu, refine, fill, budget_ops)
    assert refine <= b.steps <= max(refine, MAX_STEPS)
    if refine == 0:
        assert b.steps == 0  # refine 0 keeps local search off
    if n >= budget_ops or fill == 0.0:
        assert b.steps == refine and b.extra == ()
    assert b.extra in ((), (BUDGET_EXTRA,), (BUDGET_FREE_EXTRA,), (BUDGET_EXTRA, BUDGET_FREE_EXTRA))
    lp = BUDGET_EXTRA in b.extra
    assert lp == (0.0 < fill and LP_COST[gpu] * n <= budget_ops - n)
    assert (BUDGET_FREE_EXTRA in b.extra) == (0.0 < fill and n < budget_ops and BICPA_COST * n <= budget_ops - n)
    bigger = search_budget(n + 1, gpu, refine, fill, budget_ops)
    if bigger.extra == b.extra:
        assert bigger.steps <= b.steps  # a bigger graph never gets more search


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), gpu=st.booleans(), refine=st.integers(0, 50), fill=st.floats(0.0, 1.0),
       budget_ops=st.sampled_from([0, 50, 200]))
def test_large_baselines_adds_candidates_only_to_large_graphs_without_gpus(n, gpu, refine, fill, budget_ops):
    small = search_budget(n, gpu, refine, fill, budget_ops)
    large = search_budget(n, gpu, refine, fill, budget_ops, large_baselines=True)
    if not gpu and 0 < budget_ops < n:
        assert large.extra == LARGE_EXTRA and large.steps == refine  # no spare steps: only the candidates
    else:
        assert large == small  # a graph within the budget, or a machine with GPUs: the rule above alone


def test_bicpa_joins_small_graphs_on_top_of_their_local_search_steps(monkeypatch):
    """The free extra changes no graph's steps and no other candidate, only adds biCPA where its
    cost fits the spare budget, and never to a graph at or above the budget graph's size."""
    from opsched.policies import budget

    shipped = {(n, gpu): search_budget(n, gpu, 10, 0.7, 200) for n in range(1, 260) for gpu in (False, True)}
    monkeypatch.setattr(budget, "BUDGET_FREE_EXTRA", "")
    for (n, gpu), b in shipped.items():
        without = search_budget(n, gpu, 10, 0.7, 200)
        assert b.steps == without.steps
        assert b.extra in (without.extra, (*without.extra, "bicpa"))
        assert ("bicpa" in b.extra) == (n <= 166)  # 0.2 units per op within the 200 - n spare
    assert shipped[120, False].extra == ("lp-rounding", "bicpa")  # LP rounding's 60 units do not count
    assert shipped[120, True].extra == ("bicpa",)  # LP rounding with GPUs (3 units per op) does not fit


def test_bad_budget_input_is_refused():
    for args in [(0, False, 10, 0.5, 200), (10, False, -1, 0.5, 200), (10, False, 10, 1.5, 200),
                 (10, True, 10, 0.5, -3)]:
        with pytest.raises(ValueError, match="search_budget"):
            search_budget(*args)


@pytest.fixture(scope="module")
def learned():
    return load(pretrained_path())


def test_a_small_graph_searches_longer_and_tries_lp_rounding(learned):
    g, m = generate("layered", 30, 5), get_machine("knl-68")
    before = learned.plan(g, m, fill=0.0)
    after = learned.plan(g, m)
    assert before.meta["refine_steps"] == learned.planning()["refine"]
    assert after.meta["refine_steps"] > before.meta["refine_steps"]
    assert "heuristic:lp-rounding" in after.meta["candidates"]
    assert "heuristic:lp-rounding" not in before.meta["candidates"]
    assert "heuristic:bicpa" not in before.meta["candidates"]
    after.validate(g, m)
    sim = SimBackend(m)
    mine = sim.run(g, after).makespan
    assert mine == pytest.approx(min(after.meta["candidates"].values()))
    # never slower than anything the budget-free search started from
    unrefined = {k: v for k, v in before.meta["candidates"].items() if not k.startswith("refined(")}
    assert mine <= min(unrefined.values()) * (1 + 1e-9)
    # named candidates stay exactly those
    named = learned.plan(g, m, candidates=("heft",))
    assert set(named.meta["candidates"]) <= {"greedy", "heuristic:heft", "refined(greedy)", "refined(heuristic:heft)"}
    with pytest.raises(Exception, match="fill in"):
        learned.plan(g, m, fill=2.0)


def test_a_graph_at_the_budget_size_plans_exactly_as_without_it(learned):
    g, m = generate("erdos_renyi", 200, 7), get_machine("dgx1-4v100")
    a, b = learned.plan(g, m), learned.plan(g, m, fill=0.0)
    assert a.assignments == b.assignments
    assert a.meta["refine_steps"] == learned.planning()["refine"]
    assert "heuristic:lp-rounding" not in a.meta["candidates"]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), gpu=st.booleans(), refine=st.integers(0, 80), fill=st.floats(0.0, 1.0),
       budget_ops=st.sampled_from([0, 50, 200]), large=st.booleans())
def test_a_coarsened_graph_within_the_budget_buys_lp_rounding_and_bicpa_with_its_steps(n, gpu, refine, fill, budget_ops, large):
    """The coarsened rule: only with large_baselines, only without GPUs, only at the budget graph's
    charge; its candidate is paid for with steps at their op-unit costs; elsewhere nothing changes."""
    from opsched.policies.budget import BICPA_COST, COARSE_EXTRA, STEP_COST

    plain = search_budget(n, gpu, refine, fill, budget_ops, large)
    coarse = search_budget(n, gpu, refine, fill, budget_ops, large, coarsened=True)
    if large and not gpu and 0 < budget_ops == n:
        assert coarse.extra == COARSE_EXTRA and coarse.steps == max(0, refine - COARSE_STEPS)
        cost = sum(LP_COST[False] if h == "lp-rounding" else BICPA_COST for h in COARSE_EXTRA)
        assert COARSE_STEPS * STEP_COST >= cost > (COARSE_STEPS - 1) * STEP_COST
    else:
        assert coarse == plain


def test_the_budget_graph_without_gpus_tries_lp_rounding_and_bicpa_instead_of_local_search(learned):
    """A 200-op graph (coarsened) on a CPU-only machine: LP rounding and biCPA are candidates and the
    hint's plans hold them; the default 10 steps paid for them; never slower than the plan before the rule."""
    from opsched.benchmarks.coarse_budget import rule
    from opsched.policies.hints import episode_heuristics

    g, m = generate("erdos_renyi", 200, 7), get_machine("xeon-8180-2s")
    plan = learned.plan(g, m)
    assert {"heuristic:lp-rounding", "heuristic:bicpa"} <= set(plan.meta["candidates"])
    assert plan.meta["refine_steps"] == 0
    assert {"lp-rounding", "bicpa"} <= set(episode_heuristics(g, m, None, learned.hints, learned.max_nodes))
    plan.validate(g, m)
    assert SimBackend(m).run(g, plan).makespan == pytest.approx(min(plan.meta["candidates"].values()))
    more = learned.plan(g, m, refine=COARSE_STEPS + 50)  # a larger refine keeps what the extras did not cost
    assert more.meta["refine_steps"] == 50
    assert learned.plan(g, m, large_baselines=False).meta["refine_steps"] == learned.planning()["refine"]
    with rule("before"):
        before = learned.plan(g, m)
    assert before.meta["refine_steps"] == learned.planning()["refine"]
    assert "heuristic:lp-rounding" not in before.meta["candidates"]


def test_a_large_graph_on_a_cpu_machine_is_never_slower_than_any_baseline(learned):
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names

    g, m = generate("layered", 260, 3), get_machine("xeon-8180-2s")
    cpu = learned.plan(g, m)
    assert {f"heuristic:{h}" for h in LARGE_EXTRA} <= set(cpu.meta["candidates"])
    assert cpu.meta["refine_steps"] == learned.planning()["refine"]
    cpu.validate(g, m)
    mine = SimBackend(m).run(g, cpu).makespan
    best = min(span for _, span in heuristic_plans(g, m, None, names(BASELINE)).values())
    assert mine <= best * (1 + 1e-9)  # every baseline heuristic was a candidate
    off = learned.plan(g, m, large_baselines=False)
    assert not {f"heuristic:{h}" for h in LARGE_EXTRA} & set(off.meta["candidates"])
    gpu = learned.plan(g, get_machine("dgx1-4v100"))
    assert not {f"heuristic:{h}" for h in LARGE_EXTRA} & set(gpu.meta["candidates"])
    with pytest.raises(Exception, match="large_baselines must be"):
        learned.plan(g, get_machine("xeon-8180-2s"), large_baselines="yes")


def test_a_failing_budget_candidate_is_skipped_but_a_named_one_is_not(learned, monkeypatch):
    from opsched.errors import OpschedError
    from opsched.policies import hints, lp_rounding

    def broken(self, graph, machine, model=None):
        raise OpschedError("LP solver gave up")

    monkeypatch.setattr(lp_rounding.LPRounding, "plan", broken)
    hints.clear_cache()  # LP rounding's plan of this graph is cached from the tests above
    g, m = generate("layered", 30, 5), get_machine("knl-68")
    plan = learned.plan(g, m)
    plan.validate(g, m)
    assert "heuristic:lp-rounding" not in plan.meta["candidates"]
    with pytest.raises(OpschedError, match="gave up"):
        learned.plan(g, m, candidates=("heft", "lp-rounding"))


def test_a_coarsened_graph_has_no_spare_budget(learned):
    n = learned.max_nodes + 20
    assert n < learned.planning()["budget_ops"]
    g, m = generate("layered", n, 2), get_machine("dgx1-4v100")  # with GPUs: no coarsened rule either
    plan = learned.plan(g, m)
    assert plan.meta["refine_steps"] == learned.planning()["refine"]
    assert "heuristic:lp-rounding" not in plan.meta["candidates"]


@pytest.mark.parametrize("graph, machine", [("layered:30:5", "knl-68"), ("layered:24:3", "2x2080ti"),
                                            ("erdos_renyi:100:2", "dgx1-4v100"), ("layered:150:2", "knl-68"),
                                            ("layered:260:3", "xeon-8180-2s")])
def test_the_hint_extras_are_the_default_searchs_extra_candidates(learned, graph, machine):
    """:func:`hint_extra` (what joins the hint) is exactly what the default search adds to its candidates."""
    from opsched.policies.budget import hint_extra
    from opsched.specs import load_graph

    g, m = load_graph(graph), get_machine(machine)
    extra = hint_extra(len(g.ops), learned.max_nodes, bool(m.gpus))
    added = {k.removeprefix("heuristic:") for k in learned.plan(g, m).meta["candidates"]
             if k.startswith("heuristic:")} - set(learned.planning()["candidates"])
    assert added == set(extra)
    assert (graph == "layered:260:3") == (extra == LARGE_EXTRA)
