"""Lane plans for the ``ort`` backend, the plan choice of ``opsched.apply``, the
compare command and the benchmark's report (issue 16)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from opsched.backends.ort_lower import lower  # noqa: E402
from opsched.engine.models.analytic import AnalyticModel  # noqa: E402
from opsched.engine.models.ort_runtime import OrtRuntime  # noqa: E402
from opsched.engine.models.runtime import PlanningModel  # noqa: E402
from opsched.importers.onnx_graph import from_onnx  # noqa: E402
from opsched.machine import Machine  # noqa: E402
from opsched.policies.ort_lanes import LanePlanner, lane_plan  # noqa: E402


def _machine(cores: int) -> Machine:
    cpu = dataclasses.replace(Machine.probe().cpu, cores=cores)
    return Machine(f"ort-plans-{cores}c", (cpu,), description="ort plans test machine")


def _branches(n_branches: int = 4, length: int = 4, n: int = 96) -> bytes:
    """A stem, ``n_branches`` MatMul chains, a concat: an inception block in miniature."""
    rng = np.random.default_rng(0)
    inits, nodes, heads = [], [helper.make_node("Relu", ["x"], ["s"], name="stem")], []
    for b in range(n_branches):
        x = "s"
        for k in range(length):
            w = f"w{b}_{k}"
            inits.append(helper.make_tensor(w, TensorProto.FLOAT, [n, n], (rng.standard_normal((n, n)) / n).ravel()))
            nodes.append(helper.make_node("MatMul", [x, w], [f"m{b}_{k}"], name=f"mm{b}_{k}"))
            x = f"m{b}_{k}"
        heads.append(x)
    nodes.append(helper.make_node("Concat", heads, ["y"], axis=1, name="concat"))
    g = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, n * n_branches])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture(scope="module")
def branches():
    return from_onnx(_branches(), name="branches", opt_level="disable")


def test_lane_plan_keeps_chains_on_lanes_and_is_valid(branches):
    machine = _machine(2)
    t = np.array([1e-3 if op.kind == "matmul" else 1e-5 for op in branches.ops])
    plan = lane_plan(branches, machine, t, t, 30e-6, np.zeros(len(branches.ops), bool), cut_s=10e-6)
    plan.validate(branches, machine)
    assert {a.threads for a in plan.assignments.values()} == {1}
    low = lower(branches, plan, machine, AnalyticModel())
    lane_of = {branches.ops[i].id: s.lane for s in low.segments for i in s.ops}
    for b in range(4):  # a branch never changes lane
        assert len({lane_of[f"mm{b}_{k}"] for k in range(4)}) == 1
    assert len({lane_of[f"mm{b}_0"] for b in range(4)}) == 2, "the branches co-run"
    assert len(low.segments) <= 8


def test_wide_ops_take_every_lane(branches):
    machine = _machine(2)
    t1 = np.full(len(branches.ops), 1e-3)
    wide = np.array([op.id == "stem" for op in branches.ops])
    plan = lane_plan(branches, machine, t1, t1 / 2, 30e-6, wide)
    assert plan["stem"].threads == 2 and plan["mm0_0"].threads == 1
    low = lower(branches, plan, machine, AnalyticModel())
    first = next(s for s in low.segments if branches.index["stem"] in s.ops)
    assert first.held == (0, 1) and first.threads == 2


def test_lane_planner_picks_its_best_candidate_under_the_model(branches):
    machine = _machine(2)
    model = PlanningModel(AnalyticModel(), OrtRuntime(handoff_s=20e-6))
    planner = LanePlanner()
    cands = planner.candidates(branches, machine, model)
    assert len(cands) >= 4 and any(k.startswith("chains") for k in cands)
    plan = planner.plan(branches, machine, model)
    assert plan.policy == "ort-lanes" and plan.meta["chosen"] in cands
    assert plan.meta["candidates"][plan.meta["chosen"]] == min(plan.meta["candidates"].values())


def test_plan_for_ort_prefers_the_fastest_predicted(branches):
    from opsched.adapters.onnx import plan_for_ort
    from opsched.plan import uniform_plan

    machine = _machine(2)
    fast = PlanningModel(AnalyticModel(), OrtRuntime())
    seq = uniform_plan(branches, machine, 1, policy="one-at-a-time")
    seq = type(seq)({k: dataclasses.replace(a, after=()) for k, a in seq.assignments.items()},
                    seq.graph_fingerprint, seq.machine_fingerprint, "one-thread")
    a = plan_for_ort(branches, seq, machine, fast)
    assert a is plan_for_ort(branches, seq, machine, fast), "cached per plan"
    costly = PlanningModel(AnalyticModel(), OrtRuntime(handoff_s=1.0, op_overhead_s=0.0))
    b = plan_for_ort(branches, seq, machine, costly, lanes=True)
    assert b.policy == "ort-single", "with second-long hand-offs nothing beats one session"


def test_compare_on_ort(tmp_path):
    from typer.testing import CliRunner

    import opsched.commands.compare  # noqa: F401
    from opsched.cli import app

    path = tmp_path / "branches.onnx"
    path.write_bytes(_branches(2, 2, 32))
    res = CliRunner().invoke(app, ["compare", "--model", str(path), "--machine", "local", "--backend", "ort",
                                   "--policies", "critical-path-first", "--repeats", "2", "--gantt", "none",
                                   "--out", str(tmp_path), "--no-progress"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "critical-path-first" in res.output and "sequential" in res.output
    res = CliRunner().invoke(app, ["compare", "--model", str(path), "--machine", "local", "--backend",
                                   "torch-cpu", "--policies", "critical-path-first", "--no-progress", "--out",
                                   str(tmp_path)])
    assert res.exit_code != 0 and "--backend ort" in str(res.exception)


def test_bench_report_renders_every_section():
    from opsched.benchmarks.ort_bench import markdown

    row = {"model": "lstm", "batch": 1, "ort_sequential_ms": 4.4, "opsched_ms": 3.0, "ratio": 1.46, "ratio_q1": 1.4,
           "ratio_q3": 1.5, "plan": "ort-lanes", "lowering": {"segments": 30, "lanes": 2}, "outputs_equal": True,
           "load": {"others_cores_median": 0.1}}
    s2r = {"pooled": {"plans": 120, "mdape": 0.1, "spearman": 0.9, "within_15": 0.7, "median_ratio": 1.0},
           "per_model": [{"graph": "lstm", "plans": 20, "mdape": 0.1, "spearman": 0.9, "within_15": 0.7}]}
    app = [{"command": "opsched apply --backend ort", "seconds": 9.0, "rc": 0, "loadavg_start": [0.5, 0, 0],
            "loadavg_end": [0.6, 0, 0]}]
    md = markdown({"ratios": [row, {"model": "x", "batch": 8, "error": "boom"}], "sim_to_real": s2r, "apply": app,
                   "host": {}, "command": "python bench/ort_bench.py"})
    assert "**1.46**" in md and "Geometric mean at batch 1: **1.460**" in md and "error: boom" in md
    assert "median error **10.0%**" in md and "**9.0 s**" in md
