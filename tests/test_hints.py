"""The learned policy's hint: which heuristic plan it reads, as the episode's slots run it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opsched.engine.observe import attach_hint, prepare_episode
from opsched.engine.sim import Simulator
from opsched.engine.slots import follow_of, from_plan, to_plan
from opsched.machine import get_machine
from opsched.policies.hints import best_heuristic, episode_heuristics, heuristic_plans, hint_names, slot_hint
from opsched.specs import load_graph, load_machine


def projected(data, plan) -> float:
    """The makespan of ``plan`` as the episode's slots run it: projected, expanded following it, simulated."""
    follow = follow_of(data, plan)
    return Simulator(data.machine).makespan(data.graph, to_plan(data, follow.slots, "p", follow=follow))


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


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), max_nodes=st.sampled_from([8, 24, 128]))
@example(seed=3, max_nodes=128).via("tf-recommended's 20 ops at 28 threads, off the 56-core grid")
@example(seed=3, max_nodes=8).via("the same, coarsened")
def test_a_slot_plan_that_keeps_the_projection_follows_the_plan_member_by_member(seed, max_nodes):
    """Expanded following a plan, its own projection gives every op the plan's device and
    thread count (on a coarsened graph or not; a thread count off the level grid included);
    a slot moved to another decision is expanded as the slot plan says, and is not counted."""
    g, m = load_graph(f"layered:60:{seed}"), load_machine(f"random:{seed % 48}")
    data = prepare_episode(g, m, None, max_nodes, 4 * max_nodes)
    for name, (plan, _) in heuristic_plans(g, m).items():
        follow = follow_of(data, plan, name)
        full = to_plan(data, follow.slots, name, follow=follow)
        assert full.meta["followed"] == data.n
        for op in g.ops:
            assert (full[op.id].device, full[op.id].threads) == (plan[op.id].device, plan[op.id].threads), name
        full.validate(g, m)
        moved = follow.slots.copy()
        levels = data.static.levels[moved.device[0]]
        moved.level[0] = (moved.level[0] + 1) % len(levels)
        if len(levels) == 1:
            continue
        out = to_plan(data, moved, name, follow=follow)
        assert out.meta["followed"] == data.n - 1
        plain = to_plan(data, moved, name)
        ids = [op.id for op in g.ops]
        for i in data.coarsening.groups[0]:
            assert out[ids[i]] == plain[ids[i]]
            assert out[ids[i]].threads == levels[moved.level[0]]


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
    plans = episode_heuristics(g, m, None, learned.hints, learned.max_nodes)
    assert "lp-rounding" in plans  # coarsened, at most the budget graph's size, no GPUs: the budget's extra
    attach_hint(data, slot_hint(data, plans)[1])
    np.testing.assert_array_equal(seen.node_static, data.node_static)
    assert seen.hint_after == data.hint_after
    alone = learned.plan(g, m, samples=0, candidates=(), refine=0)
    assert alone.assignments == decode(learned, data).assignments
    assert math.isfinite(Simulator(m).makespan(g, alone))


def test_the_hint_is_also_chosen_from_the_default_searchs_extra_heuristics():
    """On a small graph the default search adds LP rounding as a candidate; the
    hint's plans hold it too (after the hint heuristics), so where it is the fastest
    the greedy decoding is hinted with it; ``budget=False`` leaves the hints alone."""
    from opsched.envs.schedule_env import ScheduleEnv
    from opsched.policies.budget import COARSE_EXTRA, LARGE_EXTRA, hint_extra
    from opsched.policies.exported import decode, load, pretrained_path
    from opsched.policies.hints import episode_heuristics

    learned = load(pretrained_path())
    g, m = load_graph("layered:24:1"), get_machine("knl-68")
    plans = episode_heuristics(g, m, None, learned.hints, learned.max_nodes)
    assert list(plans) == [*learned.hints, "lp-rounding", "bicpa"]  # biCPA: the budget's free extra
    assert list(episode_heuristics(g, m, None, learned.hints, learned.max_nodes, budget=False)) == list(learned.hints)
    data = prepare_episode(g, m, None, learned.max_nodes, learned.max_edges)
    name, plan = slot_hint(data, plans)
    assert name == "lp-rounding" and plans[name][1] < min(plans[h][1] for h in learned.hints)
    env = ScheduleEnv([g], m, max_nodes=learned.max_nodes, max_edges=learned.max_edges)
    env.reset(seed=0)
    attach_hint(data, plan)
    np.testing.assert_array_equal(env._episode(g, env._machines[0]).node_static, data.node_static)
    alone = learned.plan(g, m, samples=0, candidates=(), refine=0)
    assert alone.meta["hint"] == "lp-rounding" and alone.assignments == decode(learned, data).assignments
    # a graph the policy coarsens counts as the budget graph: LP rounding and biCPA instead of local search
    # without GPUs, nothing with them; a large one without GPUs: biCPA and LP rounding
    big = load_graph("layered:150:2")
    assert COARSE_EXTRA == ("lp-rounding", "bicpa")
    assert list(episode_heuristics(big, m, None, learned.hints, learned.max_nodes)) == [*learned.hints, *COARSE_EXTRA]
    gpus = get_machine("dgx1-4v100")
    assert list(episode_heuristics(big, gpus, None, learned.hints, learned.max_nodes)) == list(learned.hints)
    assert hint_extra(300, learned.max_nodes, False) == LARGE_EXTRA and hint_extra(300, learned.max_nodes, True) == ()


def test_an_extra_heuristic_that_fails_is_left_out_of_the_hint(monkeypatch):
    """As the default search leaves a failing extra candidate out, the hint's plans do."""
    from opsched.errors import OpschedError
    from opsched.policies import hints, lp_rounding
    from opsched.policies.hints import episode_heuristics

    def broken(self, graph, machine, model=None):
        raise OpschedError("LP solver gave up")

    monkeypatch.setattr(lp_rounding.LPRounding, "plan", broken)
    hints.clear_cache()  # LP rounding's plan of this graph is cached from the test above
    g, m = load_graph("layered:24:1"), get_machine("knl-68")
    assert list(episode_heuristics(g, m, None, hint_names(), 128)) == [*hint_names(), "bicpa"]  # the one that works


def test_refining_a_plan_offers_it_followed_and_on_the_level_grid():
    """Plan-time refinement of a moldable plan on a coarsened graph: the first expansion
    keeps the plan's own device and threads in every slot search left as it was, the
    second (where they differ) is search's own slot-by-slot plan on the level grid."""
    from opsched.policies.exported import _refine

    g, m = load_graph("erdos_renyi:80:3"), get_machine("knl-68")
    data = prepare_episode(g, m, None, 32, 128)
    plan = heuristic_plans(g, m)["cpa"][0]
    found = _refine(data, plan, "cpa", 60, np.random.default_rng(0))
    assert len(found) == 2
    followed, plain = found
    start, ids = from_plan(data, plan), [op.id for op in g.ops]
    searched = from_plan(data, plain)
    kept = [k for k in range(data.n)
            if (searched.device[k], searched.level[k]) == (start.device[k], start.level[k])]
    assert 0 < followed.meta["followed"] == len(kept) < data.n
    for k in kept:
        for i in data.coarsening.groups[k]:
            assert (followed[ids[i]].device, followed[ids[i]].threads) == (plan[ids[i]].device, plan[ids[i]].threads)
    grid = {d.id: set(d.thread_levels()) for d in m.devices}
    assert all(a.threads in grid[a.device] for a in plain.assignments.values())
    assert any(followed[k] != plain[k] for k in ids)
    for p in found:
        p.validate(g, m)


def test_the_budgets_extra_plans_do_not_cut_the_hints_bounded_search_short(monkeypatch):
    """On a coarsened CPU graph LP rounding's plan (a budget extra) is faster than every hint
    heuristic's and projects to itself; inside the bounded search it ended the search before
    TensorFlow's recommended settings, whose projection onto the groups is far faster than either
    plan. Kept apart, the extra is projected after the search and the better projection is the
    hint. biCPA's plan (the other extra) is faster still and projects to itself: with it, it is
    the hint whichever way the extras are searched."""
    from opsched.policies import hints
    from opsched.policies.budget import COARSE_EXTRA
    from opsched.policies.exported import load, pretrained_path

    learned = load(pretrained_path())
    g, m = load_graph("layered:200:901"), get_machine("xeon-8180-2s")
    plans = episode_heuristics(g, m, None, learned.hints, learned.max_nodes)
    assert plans.extra == COARSE_EXTRA == ("lp-rounding", "bicpa")
    data = prepare_episode(g, m, None, learned.max_nodes, learned.max_edges)

    def projected(name):
        follow = follow_of(data, plans[name][0], name)
        return Simulator(m).makespan(g, to_plan(data, follow.slots, name, follow=follow))

    lp_only = hints.HintPlans({k: v for k, v in plans.items() if k != "bicpa"})
    lp_only.extra = ("lp-rounding",)
    assert min(lp_only, key=lambda k: lp_only[k][1]) == "lp-rounding"  # the fastest plan of them
    name, _ = slot_hint(data, lp_only)
    assert name != "lp-rounding" and projected(name) < projected("lp-rounding") * 0.9
    assert slot_hint(data, dict(lp_only))[0] == "lp-rounding"  # a plain dict names no extras to keep apart
    assert projected("bicpa") == plans["bicpa"][1] < projected(name)
    assert slot_hint(data, plans)[0] == "bicpa"
    monkeypatch.setattr(hints, "EXTRAS_APART", False)
    assert slot_hint(data, lp_only)[0] == "lp-rounding"
    assert slot_hint(data, plans)[0] == "bicpa"


def _decoded(gspec: str, mspec: str):
    """The shipped policy's greedy episode of (gspec, mspec), hinted as the scheduler hints it."""
    from opsched.policies.exported import decode_episode, load, pretrained_path
    from opsched.policies.hints import attach_slot_hint

    learned = load(pretrained_path())
    g, m = load_graph(gspec), load_machine(mspec)
    data = prepare_episode(g, m, None, learned.max_nodes, learned.max_edges)
    attach_slot_hint(data, episode_heuristics(g, m, None, learned.hints, learned.max_nodes), None)
    ep = decode_episode(learned.encoder, data, prior_scale=float(learned.planning()["prior_scale"]))[0]
    return g, m, data, ep


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000))
@example(seed=901).via("a coarsened graph where the hint's order is the faster (knl-68: 1.0105 -> 1.000)")
def test_a_decoded_plan_dispatches_in_the_faster_of_the_episodes_and_the_hints_order(seed):
    """episode_plan keeps the devices and thread counts of the followed expansion; its
    priorities and holds are all the episode's or all the hint plan's, whichever the
    simulator finds faster on the original graph (the episode's on ties), and it says which."""
    from opsched.engine.slots import episode_plan, from_episode, in_hint_order

    g, m, data, ep = _decoded(f"layered:200:{seed}", "knl-68")
    assert not data.coarsening.identity
    own = to_plan(data, from_episode(ep), "p", follow=data.hint_follow)
    hinted = in_hint_order(own, data.hint_follow.plan)
    out = episode_plan(data, ep, "p")
    out.validate(g, m)
    hinted.validate(g, m)
    sim = Simulator(m)
    spans = {"episode": sim.makespan(g, own), "hint": sim.makespan(g, hinted)}
    for op in g.ops:
        a, h = out[op.id], data.hint_follow.plan[op.id]
        assert (a.device, a.threads) == (own[op.id].device, own[op.id].threads)
        src = h if out.meta["order"] == "hint" else own[op.id]
        assert (a.priority, a.after) == (src.priority, src.after)
    assert sim.makespan(g, out) == min(spans.values())
    if spans["hint"] < spans["episode"]:
        assert out.meta["order"] == "hint"
    elif out.assignments != hinted.assignments:
        assert out.meta["order"] == "episode"
    if seed == 901:
        assert out.meta["order"] == "hint" and spans["hint"] < spans["episode"] * (1 - 1e-3)


def test_a_plan_already_in_its_hints_order_keeps_it_without_a_replay(monkeypatch):
    """faster_order replays nothing when the hint's order changes nothing (the hint itself)."""
    from opsched.engine import sim as sim_module
    from opsched.engine.slots import faster_order

    g, m = load_graph("layered:30:2"), get_machine("knl-68")
    data = prepare_episode(g, m, None, 128, 512)
    plan = best_heuristic(g, m)[1]

    def boom(*a, **k):
        raise AssertionError("replayed")

    monkeypatch.setattr(sim_module, "replay_plan_makespan", boom)
    out = faster_order(data, plan, plan)
    assert out.assignments == plan.assignments and out.meta["order"] == "episode"
