"""The sim-to-real benchmark (``opsched.benchmarks.sim_to_real``): fresh plans, the
analysis (headline on the planning model, leave-one-model-out refit, the
performance model alone), the report files, and re-analysis from a raw file.
No measurement and no wall-clock figure: "measured" makespans are simulations
with a known runtime model.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

import opsched.backends.runtime_fit as F
import opsched.benchmarks.sim_to_real as S
from opsched.backends.sim import SimBackend
from opsched.engine.models.analytic import AnalyticModel
from opsched.engine.models.runtime import PlanningModel, TorchCPURuntime
from opsched.errors import OpschedError
from opsched.graph import OpGraph
from opsched.machine import Device, Machine
from opsched.synthetic import generate

MACHINE = Machine("two-core", (Device("cpu", "cpu", 2, 50.0, 20.0, 8.0),))
PERF = AnalyticModel()
TRUTH = TorchCPURuntime(op_overhead_s=40e-6, host_s=8e-6, corun_c0=0.1, insitu_factor=1.2,
                        thread_switch_s=100e-6, spin_s=2e-3)
META = {"command": "test", "machine": "two-core", "cores": 2, "torch": "-", "elapsed_s": 0.0,
        "loadavg_start": [0.0] * 3, "loadavg_end": [0.0] * 3, "others_cores_median": 0.0, "rounds": 3,
        "warmup": 1, "reps": 3, "quiet_cores": 0.3, "profiles": "runs/profiles", "retries": 0,
        "samples_not_quiet": 0, "planning_model": "test model", "runtime_fitted_on": ["a", "b"], "fresh_seed": 1}


def _graphs() -> dict[str, OpGraph]:
    return {"a": generate("layered", 30, 1), "b": generate("erdos_renyi", 25, 2)}


def _measured(graph: OpGraph, plans: dict, machine: Machine = MACHINE) -> dict:
    """A worker's record for ``plans``: walls simulated with the :data:`TRUTH` runtime model."""
    real = SimBackend(machine, PlanningModel(PERF, TRUTH))
    traces = {k: real.run(graph, p) for k, p in plans.items()}
    walls = {k: [t.makespan * f for f in (0.99, 1.0, 1.01)] for k, t in traces.items()}
    return {"walls": walls, "busy": {k: [t.makespan] * 3 for k, t in traces.items()},
            "others": {k: [0.0] * 3 for k in plans},
            "op_durations": {k: {e.op: e.end - e.start for e in traces[k].events}
                             for k in F.DETAIL_PLANS if k in traces}}


def _runs(fresh_names: dict[str, set[str]] | None = None) -> tuple[list[F.RuntimeRun], dict[str, set[str]]]:
    runs, fresh = [], {}
    for name, g in _graphs().items():
        plans, f = S.evaluation_plans(g, MACHINE, PlanningModel(PERF, TRUTH), 20, set())
        runs.append(F.runtime_run(name, g, plans, _measured(g, plans), MACHINE, PERF))
        fresh[name] = f if fresh_names is None else fresh_names[name]
    return runs, fresh


def test_evaluation_plans_are_fresh_and_keep_the_detail_plans() -> None:
    g = _graphs()["a"]
    fitted = F.make_plans(g, MACHINE, PERF, 16)  # what calibrate measures (seed 0)
    seen = {F.plan_digest(p) for p in fitted.values()}
    plans, fresh = S.evaluation_plans(g, MACHINE, PERF, 20, seen)
    assert len(fresh) >= 20 and fresh <= set(plans)
    assert all(F.plan_digest(plans[k]) not in seen for k in fresh)
    assert set(F.DETAIL_PLANS) <= set(plans) and not set(F.DETAIL_PLANS) & fresh  # measured, not scored
    assert set(plans) - fresh == set(F.DETAIL_PLANS)


def test_fitted_on_digests_reads_the_runtime_record(tmp_path) -> None:
    g = _graphs()["a"]
    plans = F.make_plans(g, MACHINE, PERF, 16)
    assert S.fitted_on_digests(g, MACHINE, tmp_path) == set()
    F.save_record(g, F.GraphRef("zoo:lstm"), MACHINE, plans, _measured(g, plans), {}, cache_dir=tmp_path)
    assert S.fitted_on_digests(g, MACHINE, tmp_path) == {F.plan_digest(p) for p in plans.values()}


def test_analysis_scores_the_planning_model_and_the_left_out_refit(tmp_path) -> None:
    runs, fresh = _runs()
    res = S.analyse(runs, MACHINE, PlanningModel(PERF, TRUTH), PERF, fresh)
    a = res["per_model"]["a"]
    # the planning model is the truth here: the headline error is the 1% noise of the "measurements"
    assert a["simulated_s"]["mdape"] < 0.011 and a["simulated_s"]["spearman"] > 0.95
    # each model's refit is fitted on the other model only, and comes close
    assert a["refit"]["fitted_on"] == ["b"] and res["per_model"]["b"]["refit"]["fitted_on"] == ["a"]
    assert a["simulated_lomo_s"]["mdape"] < 0.05 < a["simulated_raw_s"]["mdape"]
    assert res["pooled"]["plans"] == sum(len(f) for f in fresh.values()) == a["fresh"] + res["per_model"]["b"]["fresh"]
    assert res["pooled"]["simulated_s"]["spearman_per_model_median"] > 0.9

    res.update(META)
    S.write_markdown(res, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "| a | 30 |" in text and "| **pooled** |" in text and "## b" in text and "| seq-1t | yes |" in text
    assert "fitted on b" not in text and "test model" in text and not S.why_empty(res)
    S.plot(res, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_model_has_no_left_out_refit_and_no_fresh_plan_means_no_figure(tmp_path) -> None:
    runs, fresh = _runs()
    one = S.analyse(runs[:1], MACHINE, PlanningModel(PERF, TRUTH), PERF, fresh)
    assert one["per_model"]["a"]["simulated_lomo_s"] is None and one["per_model"]["a"]["refit"] is None
    assert one["per_model"]["a"]["simulated_s"] is not None
    stale = S.analyse(runs, MACHINE, PERF, PERF, {"a": set(), "b": set()})  # every plan was fitted on
    assert stale["pooled"]["plans"] == 0 and stale["pooled"]["simulated_s"] is None
    assert "fitted on" in S.why_empty(stale)
    (line,) = S.score_table(stale)
    assert line.startswith("No figure: every measured plan")
    with pytest.raises(ValueError, match="nothing to plot"):
        S.plot(stale, tmp_path / "x.png")
    stale.update(META)
    S.write_markdown(stale, tmp_path / "stale.md")
    assert "nan" not in (tmp_path / "stale.md").read_text().lower()
    from opsched.benchmarks.report import md_fidelity

    text = "\n".join(md_fidelity({**stale, "report": "sub/sim_to_real/sim_to_real.md"}))
    assert "No figure: every measured plan" in text and "fidelity.png" not in text and "nan" not in text.lower()


def test_cli_rejects_too_few_plans_and_unknown_models() -> None:
    with pytest.raises(SystemExit):
        S.parse_args(["--plans-per-model", "5"])
    with pytest.raises(SystemExit):
        S.parse_args(["--models", "lstm,nosuchnet"])
    args = S.parse_args(["--quick", "--models", "lstm"])
    assert args.models == ["lstm"] and args.rounds == 3 and args.reps == 2 and args.budget_s == 90.0


def test_from_raw_reads_digests_of_raw_files_and_reports_and_rejects_other_files(tmp_path) -> None:
    raw = {"measurement": {"models": {}}, "digests": {"m": {"seq-1t": "abc"}}}
    assert S.reused_digests(raw, "m") == {"seq-1t": "abc"} and S.reused_digests(raw, "x") == {}
    report = {"measurement": {"models": {}}, "rows": [{"model": "m", "plan": "seq-1t", "digest": "abc"},
                                                      {"model": "n", "plan": "seq-1t", "digest": "def"}]}
    assert S.reused_digests(report, "m") == {"seq-1t": "abc"}
    old = tmp_path / "old.json"
    old.write_text('{"rows": [], "workers": {}}')  # the format before per-plan digests
    assert S.main(["--from-raw", str(old), "--out", str(tmp_path / "out")]) == 2
    assert S.main(["--from-raw", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    g = _graphs()["a"]
    plans, _ = S.evaluation_plans(g, MACHINE, PERF, 20, set())
    data = {"measurement": {"models": {"a": {}}}, "digests": {"a": {k: F.plan_digest(p) for k, p in plans.items()}}}
    S.check_reuse(data, "a", plans)
    with pytest.raises(OpschedError, match="different planning model"):
        S.check_reuse(data, "a", dict(list(plans.items())[1:]))
    with pytest.raises(OpschedError, match="exactly these 'b' plans"):
        S.check_reuse(data, "b", plans)


def test_evaluate_from_a_raw_file_writes_the_report(tmp_path, monkeypatch) -> None:
    """``--from-raw``: the plans are made again with the planning model, checked against
    the file's digests, and scored on its measurements (the graphs stand in for zoo models)."""
    import opsched.specs

    graphs = {"lstm": _graphs()["a"], "transformer": _graphs()["b"]}
    planning = PlanningModel(PERF, TRUTH)
    monkeypatch.setattr(opsched.specs, "load_graph", lambda spec, *a, **k: graphs[spec.split(":")[1]])
    monkeypatch.setattr(S, "headline_model", lambda machine, profiles: planning)
    machine = Machine.probe().cpu_only()
    plans = {m: S.evaluation_plans(g, machine, planning, 20, set())[0] for m, g in graphs.items()}
    raw = {"format": S.RAW_FORMAT, "digests": {m: {k: F.plan_digest(p) for k, p in ps.items()}
                                               for m, ps in plans.items()},
           "measurement": {"models": {m: _measured(graphs[m], ps, machine) for m, ps in plans.items()}, "rounds": 3,
                           "warmup": 1, "reps": 3, "quiet_cores": 0.3, "retries": 0, "samples_not_quiet": 0,
                           "loadavg_start": [0.1] * 3, "loadavg_end": [0.2] * 3, "torch": "x"}}
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    args = S.parse_args(["--models", "lstm,transformer", "--plans-per-model", "20", "--from-raw", str(tmp_path / "raw.json"),
                         "--out", str(tmp_path / "out"), "--profiles", str(tmp_path / "profiles")])
    seen = []
    res = S.evaluate(args, "cmd", lambda what, done, total: seen.append(what))
    assert seen[-1] == "scoring" and not (tmp_path / "out" / "sim_to_real_raw.json").exists()
    assert res["reused_measurements_from"] == str(tmp_path / "raw.json")
    assert res["per_model"]["lstm"]["simulated_s"]["mdape"] < 0.011 and res["per_model"]["lstm"]["profiled"] is False
    S.write_outputs(res, tmp_path / "out")
    for name in ("sim_to_real.json", "sim_to_real.md", "sim_to_real.png"):
        assert (tmp_path / "out" / name).is_file(), name
    again = json.loads((tmp_path / "out" / "sim_to_real.json").read_text())
    assert again["digests"] == raw["digests"] and math.isfinite(again["pooled"]["simulated_s"]["mdape"])
    # a file measured on other plans is refused
    raw["digests"]["lstm"] = {"seq-1t": "0" * 12}
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    with pytest.raises(OpschedError, match="'lstm' plans"):
        S.evaluate(argparse.Namespace(**{**vars(args)}), "cmd")


def test_scores_skip_rows_without_figures() -> None:
    rows = [{"measured_s": 1.0, "x": 1.1}, {"measured_s": 2.0, "x": math.nan}, {"measured_s": 3.0, "x": 2.7},
            {"measured_s": 4.0, "x": 4.4}]
    s = S.score(rows, "x")
    assert s["plans"] == 3 and s["mdape"] == pytest.approx(0.1) and s["spearman"] == pytest.approx(1.0)
    assert S.score(rows[1:2], "x") is None and S.score([], "x") is None
    assert np.isnan(S.score(rows[:1], "x")["spearman"])
