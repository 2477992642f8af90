"""The learned policy's hint: which heuristic plan it reads, as the episode's slots run it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.engine.observe import attach_hint, prepare_episode
from opsched.engine.sim import Simulator
from opsched.engine.slots import from_plan, to_plan
from opsched.machine import get_machine
from opsched.policies.hints import best_heuristic, heuristic_plans, hint_names, slot_hint
from opsched.specs import load_graph, load_machine


def projected(data, plan) -> float:
    """The makespan of ``plan`` as the episode's slots run it: projected, expanded, simulated."""
    return Simulator(data.machine).makespan(data.graph, to_plan(data, from_plan(data, plan), "p"))


def test_cpa_is_a_hint_heuristic():
    """CPA joined the hint set (issue 23: chosen on validation, 1.038 -> 1.020 greedy)."""
    assert "cpa" in hint_names() and hint_names()[0] == "sequential"


def test_on_a_graph_the_policy_does_not_coarsen_the_hint_is_the_fastest_plan():
    g, m = load_graph("layered:60:3"), get_machine("knl-68")
    data = prepare_episode(g, m, None, 128, 512)
    assert data.coarsening.identity
    name, plan = slot_hint(data, heuristic_plans(g, m))
    assert (name, plan) == best_heuristic(g, m)[:2]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), max_nodes=st.sampled_from([8, 16, 24]))
def test_on_a_coarsened_graph_no_plan_projects_faster_than_the_hint(seed, max_nodes):
    """Every plan faster than the hint's projection was checked, and none projects faster.

    (The plans slower than it are skipped: a projection seldom beats its own
    plan, and that bound is what keeps the choice to a few simulations.)"""
    g, m = load_graph(f"layered:60:{seed}"), load_machine(f"random:{seed % 48}")
    data = prepare_episode(g, m, None, max_nodes, 4 * max_nodes)
    assert not data.coarsening.identity
    plans = heuristic_plans(g, m)
    name, plan = slot_hint(data, plans)
    assert plan is plans[name][0]
    mine = projected(data, plan)
    fastest = min(plans, key=lambda k: plans[k][1])
    assert mine <= projected(data, plans[fastest][0]) * (1 + 1e-12)
    for other, (p, span) in plans.items():
        if span < mine:
            assert projected(data, p) >= mine * (1 - 1e-12), other


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), max_nodes=st.sampled_from([8, 16, 24]))
def test_a_plan_that_keeps_every_group_on_one_device_has_one_projection(seed, max_nodes):
    """from_plan skips the by-time projection of such a plan: it would be the same slot plan."""
    from opsched.engine.slots import _project, _splits_a_group

    g, m = load_graph(f"layered:60:{seed}"), load_machine(f"random:{seed % 48}")
    data = prepare_episode(g, m, None, max_nodes, 4 * max_nodes)
    for name, (plan, _) in heuristic_plans(g, m).items():
        a, b = _project(data, plan, name, by_time=False), _project(data, plan, name, by_time=True)
        same = (a.device, a.level, a.rank, a.after) == (b.device, b.level, b.rank, b.after)
        assert same or _splits_a_group(data, plan), name


def test_slot_hint_refuses_an_empty_choice():
    g, m = load_graph("layered:20:1"), get_machine("knl-68")
    with pytest.raises(ValueError, match="no heuristic plan"):
        slot_hint(prepare_episode(g, m, None, 8, 32), {})


def test_the_environment_and_the_exported_scheduler_read_the_same_hint():
    """Training and planning see one observation: the env's hint columns are the scheduler's."""
    from opsched.envs.schedule_env import ScheduleEnv
    from opsched.policies.exported import decode, load, pretrained_path

    learned = load(pretrained_path())
    g, m = load_graph("layered:200:7"), get_machine("xeon-8180-2s")  # more ops than max_nodes: coarsened
    env = ScheduleEnv([g], m, max_nodes=learned.max_nodes, max_edges=learned.max_edges)
    env.reset(seed=0)
    seen = env._episode(g, env._machines[0])
    assert not seen.coarsening.identity
    data = prepare_episode(g, m, None, learned.max_nodes, learned.max_edges)
    attach_hint(data, slot_hint(data, heuristic_plans(g, m, None, learned.hints))[1])
    np.testing.assert_array_equal(seen.node_static, data.node_static)
    assert seen.hint_after == data.hint_after
    alone = learned.plan(g, m, samples=0, candidates=(), refine=0)
    assert alone.assignments == decode(learned, data).assignments
    assert math.isfinite(Simulator(m).makespan(g, alone))
