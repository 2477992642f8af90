"""Choosing among a policy's candidate plans by timing them (opsched.measured):
the shortlist is the model's best distinct plans, the fastest measured one wins,
a candidate that cannot run is dropped, and ``opsched.apply`` records it all."""

from __future__ import annotations

import math

import pytest
import torch

from opsched.errors import OpschedError
from opsched.measured import choose_measured, shortlist
from opsched.plan import Assignment, Plan
from opsched.policies.exported import pick

torch.set_num_threads(1)


def _plan(threads: int, tag: str) -> Plan:
    return Plan({"a": Assignment(threads=threads), "b": Assignment()}, "g", "m", "learned", {"chosen": tag})


CANDIDATES = {
    "greedy": (_plan(1, "greedy"), 3.0),
    "sample-0": (_plan(1, "sample-0"), 2.0),          # the same schedule as greedy
    "heuristic:sequential": (_plan(2, "seq"), 1.0),
    "heuristic:heft": (_plan(3, "heft"), 4.0),
    "odd": (_plan(4, "odd"), math.nan),
}


class FakeBackend:
    """Times a plan by its threads of op "a" (a lookup, not a clock), and
    refuses to run plans with 3 threads."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.calls = 0

    def time_plan(self, graph, plan, repeats=1, warmup=0, inputs=None):
        self.calls += 1
        threads = plan["a"].threads
        if threads == 3:
            raise OpschedError("cannot run")
        return [self.seconds[threads]]


def test_shortlist_ranks_by_prediction_and_drops_duplicate_schedules():
    short = shortlist(CANDIDATES, 3)
    assert list(short) == ["heuristic:sequential", "sample-0", "heuristic:heft"]
    assert list(shortlist(CANDIDATES, 10))[-1] == "odd"  # no prediction: last
    assert pick(CANDIDATES) is CANDIDATES["heuristic:sequential"][0]


def test_the_sequential_baseline_is_always_timed():
    ranked_last = {**CANDIDATES, "heuristic:sequential": (_plan(5, "seq"), 9.0)}
    short = shortlist(ranked_last, 2)
    assert list(short)[:2] == ["sample-0", "heuristic:heft"] and list(short)[-1] == "heuristic:sequential"
    assert list(shortlist(ranked_last, 2, always=())) == ["sample-0", "heuristic:heft"]


def test_the_fastest_measured_candidate_wins_over_the_models_choice():
    be = FakeBackend({1: 0.010, 2: 0.020})
    plan = choose_measured(be, None, CANDIDATES, (), top=3, warmup=1, repeats=2)
    assert plan["a"].threads == 1
    assert plan.meta["chosen"] == "sample-0" and plan.meta["model_choice"] == "heuristic:sequential"
    assert set(plan.meta["measured"]) == {"sample-0", "heuristic:sequential"}  # heft could not run: dropped
    assert plan.meta["measured"]["sample-0"] == pytest.approx(0.010)
    assert be.calls == 1 + 2 * 3  # one try each (3 candidates), then 2 rounds of the 2 that ran


def test_when_no_candidate_runs_the_error_says_why():
    bad = {"x": (_plan(3, "x"), 1.0),
           "y": (Plan({"a": Assignment(threads=3), "b": Assignment(threads=2)}, "g", "m", "learned"), 2.0)}
    with pytest.raises(OpschedError, match="cannot run"):
        choose_measured(FakeBackend({}), None, bad, (), top=3)


def test_a_single_distinct_candidate_is_not_timed():
    be = FakeBackend({1: 0.01})
    one = {"greedy": CANDIDATES["greedy"], "sample-0": CANDIDATES["sample-0"]}
    assert choose_measured(be, None, one, ()) is CANDIDATES["sample-0"][0] and be.calls == 0


def test_apply_times_the_learned_policys_candidates_on_the_runtime():
    from _nets import Branchy

    from opsched.scheduled import apply, outputs_equal

    torch.manual_seed(0)
    module, x = Branchy().eval(), torch.randn(2, 3, 16, 16)
    sm = apply(None, module, x, backend="torch-cpu")
    assert sm.scheduled
    meta = sm.plan.meta
    assert "measured" in meta and meta["chosen"] in meta["measured"] and meta["model_choice"] in meta["measured"]
    assert meta["measured"][meta["chosen"]] == min(meta["measured"].values())
    with torch.no_grad():
        assert outputs_equal(sm(x), module(x))
    trusted = apply(None, module, x, backend="torch-cpu", measure=0)
    assert "measured" not in trusted.plan.meta and trusted.plan.meta["chosen"] == meta["model_choice"]
