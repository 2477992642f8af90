"""HEFT against tables written out by hand: the paper's worked example and a
small one that needs the insertion policy; then HEFT on OpGraphs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.backends.sim import SimBackend
from opsched.engine.models.analytic import AnalyticModel
from opsched.machine import PRESETS
from opsched.policies.heft import HeftPolicy, heft_schedule
from opsched.synthetic import generate

# Topcuoglu, Hariri and Wu (2002), Fig. 2: 10 tasks (n1..n10 -> 0..9), 3 processors.
PAPER_COMP = np.array([
    [14, 16, 9], [13, 19, 18], [11, 13, 19], [13, 8, 17], [12, 13, 10],
    [13, 16, 9], [7, 15, 11], [5, 11, 14], [18, 12, 20], [21, 7, 16],
], dtype=float)
PAPER_COMM = {(a - 1, b - 1): float(c) for (a, b), c in {
    (1, 2): 18, (1, 3): 12, (1, 4): 9, (1, 5): 11, (1, 6): 14, (2, 8): 19, (2, 9): 16, (3, 7): 23,
    (4, 8): 27, (4, 9): 23, (5, 9): 13, (6, 8): 15, (7, 10): 17, (8, 10): 11, (9, 10): 13,
}.items()}


def test_paper_example_upward_ranks_and_order():
    s = heft_schedule(PAPER_COMP, PAPER_COMM)
    # the paper's Table of rank_u values
    assert np.allclose(s.rank, [108, 77, 80, 80, 69, 63.333, 42.667, 35.667, 44.333, 14.667], atol=1e-3)
    assert [t + 1 for t in s.order] == [1, 3, 4, 2, 5, 6, 9, 7, 8, 10]


def test_paper_example_schedule_makespan_80():
    s = heft_schedule(PAPER_COMP, PAPER_COMM)
    assert s.makespan == 80.0
    # Fig. 4(a) of the paper: (processor, start, finish) per task; processors 0..2 = P1..P3
    expected = {
        1: (2, 0, 9), 2: (0, 27, 40), 3: (2, 9, 28), 4: (1, 18, 26), 5: (2, 28, 38),
        6: (1, 26, 42), 7: (2, 38, 49), 8: (0, 57, 62), 9: (1, 56, 68), 10: (1, 73, 80),
    }
    for task, (proc, start, finish) in expected.items():
        i = task - 1
        assert (s.proc[i], s.start[i], s.finish[i]) == (proc, start, finish), f"n{task}"


# A hand-made table, worked out on paper.  Tasks A..E = 0..4, two processors.
#   comp:  A [1, 5]  B [5, 5]  C [5, 5]  D [2, 2]  E [1, 1]
#   edges: A->B 1, A->C 1, B->E 1, C->E 1, D->E 3   (D is a second entry task)
# mean costs: A 3, B 5, C 5, D 2, E 1
# rank_u: E = 1; D = 2 + 3 + 1 = 6; B = C = 5 + 1 + 1 = 7; A = 3 + 1 + 7 = 11
# order A, B, C, D, E (B before C: the tie goes to the earlier task)
# A: P0 [0, 1] (EFT 1 vs 5)
# B: P0 [1, 6] (EFT 6; P1 gets its data at 2, EFT 7)
# C: P0 would end at 11; P1 [2, 7]
# D: entry, ready at 0.  P0 is busy [0, 6] -> EFT 8.  P1 is idle before C:
#    insertion puts D at [0, 2] (EFT 2).  Without insertion P1 is free at 7
#    (EFT 9), so D goes to P0 [6, 8].
# E with insertion:    P0 needs C's data at 7 + 1 = 8 -> [8, 9]; P1 gets B's at
#                      6 + 1 = 7, D's and C's locally -> [7, 8].  Makespan 8.
# E without insertion: P0 has all data by 8 (C's at 7 + 1) -> [8, 9]; P1 waits for
#                      D's at 8 + 3 = 11 -> [11, 12].  Makespan 9.
SMALL_COMP = np.array([[1, 5], [5, 5], [5, 5], [2, 2], [1, 1]], dtype=float)
SMALL_COMM = {(0, 1): 1.0, (0, 2): 1.0, (1, 4): 1.0, (2, 4): 1.0, (3, 4): 3.0}


def test_small_table_with_insertion():
    s = heft_schedule(SMALL_COMP, SMALL_COMM)
    assert np.allclose(s.rank, [11, 7, 7, 6, 1])
    assert s.order == (0, 1, 2, 3, 4)
    assert s.proc.tolist() == [0, 0, 1, 1, 1]
    assert s.start.tolist() == [0, 1, 2, 0, 7]
    assert s.finish.tolist() == [1, 6, 7, 2, 8]
    assert s.makespan == 8.0
    assert s.lanes(2) == [[0, 1], [3, 2, 4]]  # D runs before C on P1: inserted


def test_small_table_without_insertion():
    s = heft_schedule(SMALL_COMP, SMALL_COMM, insertion=False)
    assert s.proc.tolist() == [0, 0, 1, 0, 0]
    assert s.start.tolist() == [0, 1, 2, 6, 8]
    assert s.makespan == 9.0


def test_independent_tasks_spread_over_processors():
    s = heft_schedule(np.array([[4.0, 4.0]] * 4), {}, edges=[])
    assert s.makespan == 8.0
    assert sorted(np.bincount(s.proc).tolist()) == [2, 2]


@pytest.mark.parametrize("comp, comm, edges, match", [
    (np.ones(3), {}, [], "tasks x processors"),
    (np.array([[1.0], [-1.0]]), {}, [], ">= 0"),
    (np.ones((2, 1)), {(0, 5): 1.0}, None, "not between"),
    (np.ones((2, 1)), {(0, 1): 1.0, (1, 0): 1.0}, None, "cycle"),
    (np.ones((2, 1)), {(0, 1): float("nan")}, None, "finite"),
])
def test_bad_tables_are_rejected(comp, comm, edges, match):
    with pytest.raises(ValueError, match=match):
        heft_schedule(comp, comm, edges)


class _NoInterference(AnalyticModel):
    """The analytic model without co-run slowdown or GPU compute sharing: HEFT's own assumption."""

    def slowdown(self, device, demands):
        return np.ones_like(np.asarray(demands, dtype=float))

    def occupancy(self, op, device):
        return 0.0


@pytest.mark.parametrize("machine", sorted(PRESETS))
@pytest.mark.parametrize("family", ["layered", "erdos_renyi"])
def test_heft_plan_replays_its_own_schedule(machine, family):
    """The plan's lane chains reproduce HEFT's schedule exactly in the simulator
    when ops do not interfere (HEFT's model of processors)."""
    m, model = PRESETS[machine], _NoInterference()
    g = generate(family, 40, 3)
    plan = HeftPolicy().plan(g, m, model)
    trace = SimBackend(m, model=model).run(g, plan)
    assert trace.makespan == pytest.approx(plan.meta["predicted_makespan"], rel=1e-9)
    assert plan.meta["cpu_executors"] * plan.meta["cpu_threads"] <= m.cpu.cores


def test_heft_uses_several_gpus_on_a_wide_graph():
    g = generate("layered", 80, 0, mean_width=8.0)
    plan = HeftPolicy().plan(g, PRESETS["dgx1-4v100"])
    assert len({a.device for a in plan.assignments.values() if a.device.startswith("gpu")}) >= 2


def _heft_every_split(g, m, model):
    """HEFT without bounds: every CPU executor split scheduled, the first fastest kept."""
    pol = HeftPolicy()
    table = model.time_table(g, m)
    best = None
    for t in m.cpu.thread_levels():
        sched = pol._schedule(g, m, model, table, pol._lanes(m, t))
        assert sched.makespan >= pol._bound(g, m, table, t) * (1 - 1e-12), "the bound must hold"
        if best is None or sched.makespan < best[0]:
            best = (sched.makespan, t)
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["layered", "erdos_renyi", "watts_strogatz", "fork_join"]), n=st.integers(2, 50),
       seed=st.integers(0, 10_000), machine=st.sampled_from(sorted(PRESETS)))
def test_heft_skipping_splits_by_their_bound_picks_what_scheduling_every_split_picks(family, n, seed, machine):
    g, m = generate(family, n, seed), PRESETS[machine]
    model = AnalyticModel()
    plan = HeftPolicy().plan(g, m, model)
    span, threads = _heft_every_split(g, m, model)
    assert plan.meta["cpu_threads"] == threads and plan.meta["predicted_makespan"] == pytest.approx(span, rel=1e-12)


def _textbook_heft(comp, comm, order, insertion=True):
    """HEFT's processor selection as the paper states it, with no shortcut: every task in
    ``order`` goes to the processor of earliest finish (the first of equals), the earliest
    gap that fits with insertion, else after the processor's last task."""
    n, p = comp.shape
    pred = [[a for (a, b) in comm if b == i] for i in range(n)]
    proc, start, finish = [-1] * n, [0.0] * n, [0.0] * n
    busy = [[] for _ in range(p)]  # (start, finish), sorted
    for i in order:
        best = None
        for q in range(p):
            ready = max([finish[j] + (0.0 if proc[j] == q else comm[j, i]) for j in pred[i]], default=0.0)
            w = comp[i, q]
            if insertion:
                s = ready
                for a, b in busy[q]:
                    if s + w <= a:
                        break
                    s = max(s, b)
            else:
                s = max(ready, busy[q][-1][1] if busy[q] else 0.0)
            if best is None or s + w < best[2]:
                best = (q, s, s + w)
        q, s, f = best
        proc[i], start[i], finish[i] = q, s, f
        busy[q] = sorted(busy[q] + [(s, f)])
    return proc, start, finish


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 25), p=st.integers(1, 6), seed=st.integers(0, 10_000), insertion=st.booleans(),
       ties=st.booleans())
def test_heft_schedule_equals_the_textbook_selection(n, p, seed, insertion, ties):
    """Its shortcuts (a processor that cannot finish first is not searched for a gap) change
    nothing: the same processor, start and finish for every task, ties included (``ties``:
    integer costs on few distinct values, so equal finish times are common)."""
    rng = np.random.default_rng(seed)
    comp = rng.integers(1, 4, (n, p)).astype(float) if ties else rng.uniform(0.5, 5.0, (n, p))
    comm = {(a, b): float(rng.integers(0, 3)) if ties else float(rng.uniform(0, 3))
            for b in range(n) for a in range(b) if rng.random() < 0.25}
    s = heft_schedule(comp, comm, list(comm), insertion=insertion)
    proc, start, finish = _textbook_heft(comp, comm, s.order, insertion)
    assert s.proc.tolist() == proc
    assert s.start.tolist() == pytest.approx(start, abs=0) and s.finish.tolist() == pytest.approx(finish, abs=0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), p=st.integers(1, 7), n_dev=st.integers(1, 3), seed=st.integers(0, 10_000),
       insertion=st.booleans(), ties=st.booleans())
def test_the_compiled_selection_is_the_python_loops_float_for_float(n, p, n_dev, seed, insertion, ties):
    """``heft_schedule(..., edge_cost=)`` (the loop over arrays, compiled by numba where it is
    installed, and the same source run as Python) gives the schedule of the loop on Python
    lists with a ``transfer`` callback: the same processor, start and finish for every task."""
    from opsched.engine.fast_replay import available

    rng = np.random.default_rng(seed)
    comp = rng.integers(1, 4, (n, p)).astype(float) if ties else rng.uniform(0.5, 5.0, (n, p))
    edges = [(a, b) for b in range(n) for a in range(b) if rng.random() < 0.25]
    groups = sorted(int(rng.integers(n_dev)) for _ in range(p))
    cost = rng.integers(0, 3, (len(edges), n_dev, n_dev)).astype(float) if ties \
        else rng.uniform(0, 3, (len(edges), n_dev, n_dev))
    for d in range(n_dev):
        cost[:, d, d] = 0.0
    index = {e: k for k, e in enumerate(edges)}

    def transfer(i, j, a, b):
        return float(cost[index[i, j], a, b])

    comm = dict.fromkeys(edges, 0.0)
    mean = {e: float(cost[index[e]].mean()) for e in edges}
    kw = {"groups": groups, "transfer": transfer, "mean_comm": mean, "insertion": insertion}
    lists = heft_schedule(comp, comm, edges, **kw)
    runs = [heft_schedule(comp, comm, edges, **kw, edge_cost=cost, jit=False)]
    if available():  # numba is there: the compiled loop too
        runs.append(heft_schedule(comp, comm, edges, **kw, edge_cost=cost))
    for s in runs:
        assert s.order == lists.order
        assert s.proc.tolist() == lists.proc.tolist()
        assert s.start.tolist() == lists.start.tolist() and s.finish.tolist() == lists.finish.tolist()
