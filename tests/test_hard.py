"""The hard families, busy cores, the best known plan, and the ceiling columns of compare and the bench."""

from __future__ import annotations

import csv
import importlib.util
import math

import pytest
from _moldable import PerfectScaling, chain

from opsched.backends.sim import SimBackend
from opsched.ceiling import best_known, iterated_local_search
from opsched.engine.observe import check_machine
from opsched.errors import MachineError
from opsched.graph import Op, OpGraph
from opsched.hard import MACHINES, PAIRS, SEED_MODELS, TRAIN_PAIRS, evaluation_pairs, hard_machine
from opsched.machine import Device, Machine
from opsched.plan import Assignment, Plan
from opsched.policies import get_policy
from opsched.specs import load_graph, load_machine
from opsched.synthetic import HARD_FAMILIES, generate

needs_ortools = pytest.mark.skipif(importlib.util.find_spec("ortools") is None, reason="needs OR-Tools")


# ------------------------------------------------------------------ machines
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_hard_machines_are_specs_seeded_and_fit_the_environment(name):
    m = load_machine(f"hard:{name}:7")
    assert m.fingerprint() == hard_machine(name, 7).fingerprint()
    assert m.fingerprint() != hard_machine(name, 8).fingerprint()
    check_machine(m)
    assert Machine.from_dict(m.to_dict()).fingerprint() == m.fingerprint()  # busy_cores round-trips


def test_hard_machine_errors_are_clear():
    with pytest.raises(MachineError, match="the hard machines are"):
        load_machine("hard:nope:1")
    with pytest.raises(MachineError, match="integer seed"):
        load_machine("hard:busy:x")


def test_busy_cores_are_checked_and_leave_idle_machines_as_they_were(tmp_path):
    with pytest.raises(MachineError, match="busy_cores"):
        Device("cpu", "cpu", 8, 50.0, 40.0, 64.0, busy_cores=8)
    with pytest.raises(MachineError, match="busy_cores"):
        Device("gpu:0", "gpu", 4, 1e4, 900.0, 16.0, busy_cores=1)
    with pytest.raises(MachineError, match="busy_cores"):
        Device("cpu", "cpu", 8, 50.0, 40.0, 64.0, busy_cores=-1)
    idle = Machine("m", (Device("cpu", "cpu", 8, 50.0, 40.0, 64.0),))
    assert "busy_cores" not in idle.to_dict()["devices"][0]  # idle machines keep their fingerprints
    busy = Machine("m", (Device("cpu", "cpu", 8, 50.0, 40.0, 64.0, busy_cores=2),))
    assert busy.to_dict()["devices"][0]["busy_cores"] == 2.0 and busy.fingerprint() != idle.fingerprint()
    (tmp_path / "busy.yaml").write_text(busy.to_yaml())
    assert Machine.from_yaml(tmp_path / "busy.yaml").fingerprint() == busy.fingerprint()


def _one_op_time(m: Machine, threads: int, model=None) -> float:
    g = OpGraph((Op("a", "a", "matmul", 8e9, 1e3, 1e3, 0.0, (1, 16)),), (), name="one")
    plan = Plan.build(g, m, {"a": Assignment("cpu", threads, 1.0)})
    return SimBackend(m, model).run(g, plan).makespan


def test_busy_cores_slow_a_team_to_its_slowest_thread():
    model = PerfectScaling()
    idle = Machine("idle", (Device("cpu", "cpu", 16, 40.0, 1e4, 64.0),))
    busy = Machine("busy", (Device("cpu", "cpu", 16, 40.0, 1e4, 64.0, busy_cores=6),))
    t16, t10 = _one_op_time(idle, 16, model), _one_op_time(idle, 10, model)
    assert _one_op_time(busy, 10, model) == pytest.approx(t10)  # fits in the free cores
    assert _one_op_time(busy, 16, model) == pytest.approx(2 * t16)  # 22 threads on 16 cores: every barrier waits
    assert _one_op_time(busy, 1, model) == pytest.approx(_one_op_time(idle, 1, model))


# ------------------------------------------------------------------ graphs
@pytest.mark.parametrize("family", HARD_FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 17, 60])
def test_hard_graphs_have_any_size(family, n):
    g = generate(family, n, 3)
    assert len(g.ops) == n and len(g.topological_order()) == n
    assert generate(family, n, 3) == g  # seeded
    assert load_graph(f"{family}:{n}:3") == g  # and a spec


def test_fork_join_heavy_branches_write_big_tensors_into_the_join():
    g = generate("fork_join", 26, 911)
    heavy = set(g.meta["heavy"])
    assert len(heavy) == 4 and g.meta["width"] == 8
    into_join = {e.src: e.bytes for e in g.edges if e.dst == "join"}
    big = [b for src, b in into_join.items() if int(src[1:].split("_")[0]) in heavy]
    small = [b for src, b in into_join.items() if int(src[1:].split("_")[0]) not in heavy]
    assert min(big) == pytest.approx(16 * max(small))


def test_mixed_scaling_spans_decades_and_its_small_ops_want_few_threads():
    from opsched.engine.sim import prepare

    g, m = generate("mixed_scaling", 80, 917), hard_machine("manycore", 917)
    flops = sorted(op.flops for op in g.ops)
    assert flops[-1] / flops[0] > 300
    table = prepare(g, m).table
    best_level = table.times[:, 0, :].argmin(axis=1)
    assert best_level.min() < best_level.max() - 2  # no one team size is best for every op


def test_dcgan_is_radfords_generator():
    g = generate("dcgan", 10, 0, batch=16)
    assert [op.id for op in g.ops][:4] == ["project", "bn0", "deconv0", "act0"]
    assert g.op("deconv3").shape == (16, 3, 64, 64)


def test_every_hard_pair_names_loadable_specs():
    from opsched.agents import splits

    splits.check()
    assert set(TRAIN_PAIRS) <= set(splits.TRAIN.pairs)
    assert {(g, m) for _, g, m in evaluation_pairs()} == set(splits.TEST.pairs)
    assert set(PAIRS) and set(SEED_MODELS) == {"Liu'19", "Graphi", "NN Maestro"}
    for g, m in [*((g, m) for _, g, m in evaluation_pairs()), *TRAIN_PAIRS]:
        load_machine(m)
        if not g.startswith("zoo:"):
            load_graph(g)


# --------------------------------------------------------------- best known
def test_iterated_local_search_never_loses_its_start():
    g, m = generate("layered", 25, 4), hard_machine("busy", 2)
    start = get_policy("tf-default").plan(g, m)
    plan, span = iterated_local_search(g, m, None, start, 150, seed=1)
    s0 = SimBackend(m).run(g, start).makespan
    assert span <= s0 and SimBackend(m).run(g, plan).makespan == pytest.approx(span)


@needs_ortools
def test_best_known_is_the_fastest_candidate_and_above_the_bound():
    g, m = generate("fork_join", 14, 5), hard_machine("slow-links", 5)
    best = best_known(g, m, cpsat_s=1, search_trials=5, local_steps=60)
    assert best.source in best.candidates and best.makespan_s == min(best.candidates.values())
    assert {"heuristic:heft", "heuristic:cpa", "cpsat", "search", "local-search"} <= set(best.candidates)
    assert SimBackend(m).run(g, best.plan).makespan == pytest.approx(best.makespan_s)
    assert best.lp_bound_s <= best.lower_bound_s <= best.makespan_s * (1 + 1e-9)
    assert best.gap >= 1 - 1e-9


def test_local_search_starts_from_the_best_cpsat_and_learned_plans(monkeypatch):
    """The ceiling's iterated local search runs from the best plan so far and from
    CP-SAT's and the learned policy's, so a CP-SAT run that stops short of the
    learned plan does not leave the best known plan at the learned one."""
    import opsched.ceiling as C
    from opsched.engine.bounds import CpSatResult

    g, m = generate("layered", 12, 3), load_machine("xeon-8180-2s")
    cp_plan = get_policy("sequential").plan(g, m)  # slower than the learned plan: not the best so far
    cp_span = SimBackend(m).run(g, cp_plan).makespan
    monkeypatch.setattr("opsched.engine.bounds.cpsat_schedule",
                        lambda *a, **k: CpSatResult(cp_plan, cp_span, cp_span, 0.0, False, "FEASIBLE", 0.0, 1e-6))
    starts = []
    real = C.iterated_local_search

    def spy(graph, machine, model, start, steps, seed=0):
        starts.append(start)
        return real(graph, machine, model, start, steps, seed)

    monkeypatch.setattr(C, "iterated_local_search", spy)
    best = best_known(g, m, policies=["sequential", "cpa"], cpsat_s=1, search_trials=0, local_steps=30)
    assert best.candidates["cpsat"] > min(best.candidates["learned"], best.candidates["heuristic:cpa"])
    assert any(x is cp_plan for x in starts) and len(starts) >= 2  # CP-SAT's, the learned (or best) one
    assert best.candidates["local-search"] <= min(v for k, v in best.candidates.items() if k != "local-search")


def test_best_known_without_the_expensive_methods():
    g, m = chain(4), Machine("c8", (Device("cpu", "cpu", 8, 50.0, 1e4, 64.0),))
    best = best_known(g, m, policies=["sequential", "cpa"], learned=False, cpsat_s=0, search_trials=0,
                      local_steps=0)
    assert set(best.candidates) == {"heuristic:sequential", "heuristic:cpa"}
    assert best.cpsat_status == "not run" and math.isnan(best.cpsat_bound_s)


# ------------------------------------------------------ compare and benches
@needs_ortools
def test_compare_reports_the_tight_bound_and_the_best_known_plan(tmp_path):
    from opsched.commands.compare import run_compare

    run_dir, rows = run_compare(["layered:14:3"], "xeon-8180-2s", "sim", "cpa,bicpa", out=tmp_path,
                                progress=False, ceiling_s=1, gantt="none")
    with open(run_dir / "results.csv") as fh:
        csv_rows = [r for r in csv.DictReader(fh) if r["graph"] != "geomean"]
    assert {r["policy"] for r in csv_rows} == {"sequential", "cpa", "bicpa", "cpsat"}
    best = min(float(r["makespan_s"]) for r in csv_rows)
    for r in csv_rows:
        assert float(r["lp_bound_s"]) >= float(r["lower_bound_s"]) * (1 - 1e-9)
        assert float(r["tight_lb_ratio"]) >= 1 - 1e-9
        assert float(r["best_known_s"]) == pytest.approx(best)
        assert float(r["best_known_ratio"]) == pytest.approx(float(r["makespan_s"]) / best)
    assert min(float(r["best_known_ratio"]) for r in csv_rows) == pytest.approx(1.0)


@needs_ortools
def test_hard_bench_measures_a_pair_and_writes_its_report(tmp_path):
    import argparse

    from opsched.benchmarks.hard import run_section, write_markdown

    args = argparse.Namespace(cpsat_s=1.0, search_trials=3, local_steps=30)
    sec = run_section([("fork-join/slow-links", "fork_join:14:5", "hard:slow-links:5")], args, tmp_path)
    (row,) = sec["rows"]
    assert row["heuristic_over_best_known"] >= 1 - 1e-9 and row["lp_over_old_bound"] >= 1 - 1e-9
    assert row["best_known_s"] >= row["tight_bound_s"] * (1 - 1e-9)
    res = {"command": "test", "host": {"host": "h", "cpu_count": 2}, "load_start": 0, "load_end": 0,
           "seconds": 1.0, "cpsat_s": 1, "search_trials": 3, "local_steps": 30, "hard": sec}
    write_markdown(res, tmp_path / "hard.md")
    text = (tmp_path / "hard.md").read_text()
    assert "fork_join:14:5" in text and "Memory caps" in text


@needs_ortools
def test_learned_bench_exact_gaps_use_the_shared_cpsat_model():
    from opsched.benchmarks.learned import exact_gaps

    (row,) = exact_gaps(get_policy("cpa"), n_graphs=1, time_limit_s=5)
    assert row["proved_optimal"] and row["heuristic_gap"] >= -1e-9
    assert row["lower_bound_s"] <= row["optimum_s"] * (1 + 1e-9)


def test_gap_closed_is_the_share_of_the_heuristic_gap_the_learned_plan_closes():
    from opsched.benchmarks.hard import gap_closed

    assert gap_closed(1.2, 1.0, 1.0) == pytest.approx(1.0)   # the learned plan is the best known
    assert gap_closed(1.2, 1.2, 1.0) == pytest.approx(0.0)   # it only ties the best heuristic
    assert gap_closed(1.2, 1.1, 1.0) == pytest.approx(0.5)
    assert gap_closed(1.2, 1.3, 1.0) < 0                     # slower than the heuristic
    assert gap_closed(1.01, 1.0, 1.0) is None                # the heuristic is within 2%: no gap to close
    assert gap_closed(1.2, None, 1.0) is None
