"""The benchmark harness (``opsched.benchmarks``): its pieces, ``opsched bench``, and a
``--quick`` run into a temporary folder that writes the report, the raw figures
and the PNGs with the right structure.

Presence and structure only -- never a timing.  The quick run takes one zoo
model, no ``torch.compile``, no TensorFlow, no simulator or costs section,
and no profiles (so the fidelity section must say why it is empty): well under a
minute on a shared 2-core machine; the simulator section is checked in-process.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import opsched.benchmarks.harness as H
from opsched.benchmarks import run_all, sections
from opsched.benchmarks.report import headline
from opsched.timing import Timings, geomean

REPO = Path(__file__).resolve().parent.parent


def test_round_ratios_pair_rounds_and_report_spread() -> None:
    t = Timings({"eager": [2.0, 4.0, 2.0], "fast": [1.0, 2.0, 1.0], "slow": [4.0, 8.0, 6.0],
                 "broken": [math.nan, 2.0, 2.0]})
    r = t.ratios("eager")
    assert r["eager"]["median"] == 1.0
    assert r["fast"]["median"] == pytest.approx(0.5) and r["fast"]["q1"] == r["fast"]["q3"] == pytest.approx(0.5)
    assert r["slow"]["median"] == pytest.approx(2.0) and r["slow"]["max"] == pytest.approx(3.0)
    assert r["broken"]["n"] == 2  # a round without a time is left out, not a NaN ratio
    assert geomean([1.0, 4.0]) == pytest.approx(2.0) and math.isnan(geomean([]))


def test_clocked_times_calls_not_their_setup() -> None:
    from opsched.timing import clocked

    made, seen = [], []
    runs = clocked(seen.append, repeats=3, warmup=2, setup=lambda: made.append(len(made)) or len(made))
    assert made == [0, 1, 2, 3, 4] and seen == [1, 2, 3, 4, 5]  # a fresh input per call, warm-up calls first
    assert len(runs.cpu_s) == len(runs.wall_s) == len(runs.results) == 3
    assert set(runs.per_second(10.0)) == {"cpu", "wall"}


class _FakeWorker:
    """A worker whose configurations take fixed times; ``fail`` ones die on the first timed round."""

    proc = None

    def __init__(self, times: dict[str, float], fail: tuple[str, ...] = ()) -> None:
        self.times, self.fail, self.calls = times, fail, []

    def time(self, config: str, iters: int, timeout: float) -> list[float]:
        self.calls.append((config, iters))
        if config in self.fail and len(self.calls) > len(self.times):
            raise H.WorkerError(f"{config}: worker exited")
        return [self.times[config]] * iters


def test_time_workers_interleaves_sizes_calls_and_drops_failures() -> None:
    w = _FakeWorker({"fast": 0.01, "slow": 1.0, "bad": 0.01}, fail=("bad",))
    configs = [("fast", w, "fast"), ("slow", w, "slow"), ("bad", w, "bad")]
    steps = []
    timings, failed = H.time_workers(configs, rounds=3, iters=5, warmup=2, timeout=1.0, settle_s=0.0,
                                     on_step=steps.append, target_s=0.25)
    assert set(timings.samples) == {"fast", "slow"} and set(failed) == {"bad"}
    assert timings.samples["fast"] == [0.01] * 3 and timings.samples["slow"] == [1.0] * 3
    assert len(timings.others_cores) == 3  # one load record per round
    assert ("fast", 5) in w.calls and ("slow", 1) in w.calls  # calls per round sized by the warm-up speed
    assert timings.ratios("fast")["slow"]["median"] == pytest.approx(100.0)
    assert steps.count("fast") == 4  # the warm-up and three rounds


class _StartWorker:
    """A worker that records when it is started and waited for."""

    def __init__(self, name: str, events: list, fail: bool = False) -> None:
        self.name, self.events, self.fail = name, events, fail

    def start(self) -> None:
        self.events.append(("start", self.name))

    def wait_ready(self, timeout: float) -> None:
        self.events.append(("ready", self.name))
        if self.fail:
            raise H.WorkerError(f"{self.name}: worker exited")

    def close(self, kill: bool = False) -> None:
        self.events.append(("close", self.name))


def test_start_all_prepares_the_measuring_worker_alone_after_the_others() -> None:
    """``opsched.train_step``'s set-up times candidate plans and looks for busy
    cores, so it must not prepare beside the other configurations' set-up."""
    events: list = []
    workers = [_StartWorker("eager", events), _StartWorker("train_step", events), _StartWorker("cpa", events, fail=True)]
    failed = H.start_all(workers, timeout=5.0, alone=("train_step",))
    assert set(failed) == {"cpa"}
    assert events == [("start", "eager"), ("start", "cpa"), ("ready", "eager"), ("ready", "cpa"), ("close", "cpa"),
                      ("start", "train_step"), ("ready", "train_step")]
    events.clear()
    H.start_all(workers[:2], timeout=5.0)  # by default all prepare together
    assert events[:2] == [("start", "eager"), ("start", "train_step")]


def test_headline_names_the_largest_gap() -> None:
    def g(model: str, ours: float, ort: float) -> dict:
        ratio = {"eager": {"median": 1.0, "q1": 1.0, "q3": 1.0, "n": 3},
                 "ort-seq": {"median": ort, "q1": ort, "q3": ort, "n": 3},
                 "opsched:critical-path-first": {"median": ours, "q1": ours, "q3": ours, "n": 3}}
        return {"model": model, "batch": 1, "ratio": ratio, "time_s": {"eager": {"median": 0.01}},
                "skipped": {"compile": "left out"}, "identical_plans": {}}

    lines, sentence, gaps = headline({"opsched_column": "critical-path-first",
                                      "groups": [g("a", 0.8, 0.9), g("b", 0.9, 0.6)]})
    assert lines[0].startswith("| model | batch |") and len(lines) == 4
    assert "b at batch 1" in sentence and "1.50x" in sentence and "ORT sequential" in sentence
    assert {x["model"] for x in gaps} == {"a", "b"}


def test_train_time_to_beat_cpf_reads_the_newest_run(tmp_path: Path) -> None:
    assert "skipped" in sections.train_time_to_beat_cpf(tmp_path)
    run = tmp_path / "ppo_1"
    run.mkdir()
    (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n5000,60,1.20\n10000,120,0.98\n15000,180,0.95\n")
    (run / "command.txt").write_text("opsched train-policy\n")
    r = sections.train_time_to_beat_cpf(tmp_path)
    assert r["beat_cpf"] and r["steps"] == 10000 and r["wall_s"] == 120 and r["command"] == "opsched train-policy"
    (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n5000,60,1.20\n")
    r = sections.train_time_to_beat_cpf(tmp_path)
    assert r["beat_cpf"] is False and r["final_gmean_cpf"] == 1.2


def test_train_time_to_beat_cpf_prefers_a_run_of_todays_default(tmp_path: Path) -> None:
    """A run counts as default by the hyperparameters it resolved to, not by
    its entry's name: one made under an older default is passed over."""
    import os

    import yaml

    from opsched.agents.config import load_hyperparams

    current = load_hyperparams("default")
    for name, ppo, mtime in (("ppo_1", current, 1_000), ("ppo_2", {**current, "rounds": 99}, 2_000)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"hyperparams": "default", "seed": 0, "ppo": ppo}))
        (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n0,40,0.99\n")
        os.utime(run / "evaluations.csv", (mtime, mtime))
    assert sections.train_time_to_beat_cpf(tmp_path)["run"].endswith("ppo_1")


def test_arguments_are_checked_before_a_run_folder_exists(tmp_path: Path) -> None:
    for bad in (["--models", "nosuchnet"], ["--sections", "real,nope"], ["--fidelity-plans", "5"]):
        with pytest.raises(SystemExit):
            run_all.parse_args(["--out", str(tmp_path), *bad])
    assert not list(tmp_path.iterdir())


def test_profile_runs_opsched_profile_for_models_without_profile_or_runtime_record(tmp_path, monkeypatch) -> None:
    """``--profile`` profiles the way ``opsched profile`` does (it runs that command)
    for each zoo model and batch lacking the profile or the runtime measurements."""
    from opsched.backends.runtime_fit import record_path
    from opsched.engine.profiles import cache_path
    from opsched.machine import Machine
    from opsched.specs import load_graph

    calls = []
    monkeypatch.setattr(H, "run_module", lambda module, argv, **kw: calls.append((module, list(argv))) or (0, ""))
    profiles = tmp_path / "profiles"
    graph = load_graph("zoo:lstm", 1)
    machine = Machine.probe()
    for path in (cache_path(graph, machine, profiles), record_path(graph, machine, "torch-cpu", profiles)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    notes = run_all.profile_missing(["lstm", "transformer"], [1], {"profiles": profiles, "env": {}}, tmp_path)
    assert notes == {"lstm b1": "already profiled", "transformer b1": "profiled"}
    assert calls == [("opsched", ["profile", "zoo:transformer", "--batch", "1", "--out", str(profiles),
                                  "--no-progress"])]


def test_bench_scripts_are_thin_entry_points_and_nothing_edits_sys_path() -> None:
    needle = "sys." + "path"
    for f in sorted((REPO / "bench").glob("*.py")):
        text = f.read_text()
        code = [ln for ln in text.split('"""')[-1].splitlines() if ln.strip()]
        assert code[0].startswith("from opsched.") and code[0].endswith(" import main") and len(code) <= 3, f.name
    for f in sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "tests").glob("*.py")):
        assert needle not in f.read_text(), f.name


def test_cli_runs_the_installed_harness(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    import opsched.commands.bench  # noqa: F401  (registers `opsched bench`)
    from opsched.cli import app

    res = CliRunner().invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "--quick" in res.output and "--profiles" in res.output
    # the harness is a module of the package, not a file beside it: any folder will do
    proc = subprocess.run([sys.executable, "-m", "opsched.benchmarks.run_all", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--sections" in proc.stdout


def test_costs_runs_a_benchmark_module_and_keeps_its_summary(tmp_path: Path) -> None:
    res = sections._sub_bench("sim_speed", ["--quick", "--ops", "20"], tmp_path, 120, H.worker_env())
    assert res["command"].startswith("python -m opsched.benchmarks.sim_speed --quick")
    assert res["summary"]["median_ops_per_s"] > 0 and (tmp_path / res["raw_file"]).is_file()
    missing = sections._sub_bench("sim_speed", ["--no-such-flag"], tmp_path, 120, H.worker_env())
    assert missing["skipped"].startswith("python -m opsched.benchmarks.sim_speed exited with status 2")


@pytest.mark.slow
def test_sim_section_rows_summary_report_and_figure(tmp_path: Path) -> None:
    from opsched.benchmarks.report import write_figures, write_report

    args = run_all.parse_args(["--quick", "--search-trials", "2", "--out", str(tmp_path)])
    ctx = {"learned": None, "learned_where": "left out (--policy none)"}
    with H.progress_bar(disable=True) as bar:
        sim = sections.section_sim(args, ctx, tmp_path, bar)
    assert sim["rows"] and all(r["lb_ratio"] >= 1.0 - 1e-9 for r in sim["rows"])
    # the ceiling columns (issue 23): the LP bound is the tighter one, the best plan of the pair is 1
    assert all(r["tight_lb_ratio"] >= 1.0 - 1e-9 and r["lp_bound_s"] >= r["lower_bound_s"] * (1 - 1e-9)
               and r["best_known_ratio"] >= 1.0 - 1e-9 for r in sim["rows"])
    assert {r["policy"] for r in sim["rows"]} >= {"sequential", "critical-path-first", "search"}
    assert set(sim["summary"]) == set(sim["presets"]) and not sim["skipped"]
    results = {"command": "test", "quick": True, "started": "now", "machine": H.machine_description(),
               "versions": {}, "sections": {"sim": sim}}
    results["figures"] = write_figures(tmp_path, results)
    write_report(tmp_path, results)
    report = (tmp_path / "report.md").read_text()
    assert "## 2. Scale in the simulator" in report and "](sim_scale.png)" in report
    assert (tmp_path / "sim_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_run_writes_report_results_and_figures(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "opsched.benchmarks.run_all", "--quick", "--out", str(tmp_path), "--models", "lstm",
           "--no-compile", "--sections", "real,fidelity", "--no-progress",
           "--profiles", str(tmp_path / "no_profiles")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr[-3000:]
    runs = sorted(tmp_path.glob("bench_[0-9]*"))
    assert len(runs) == 1
    out = runs[0]
    for name in ("report.md", "results.json", "command.txt", "machine.json", "versions.json"):
        assert (out / name).is_file(), name
    assert "opsched.benchmarks.run_all --quick" in (out / "command.txt").read_text()
    res = json.loads((out / "results.json").read_text())
    assert res["quick"] is True and set(res["sections"]) == {"real", "fidelity"}
    assert res["versions"]["torch"] and isinstance(res["machine"]["opsched_machine"], dict)
    assert res["machine"]["cpu_count"] and "loadavg" in res["machine"]

    # 1: the eager reference and the ratios to it, for every configuration that ran, and the load
    real = res["sections"]["real"]
    assert not real.get("skipped_groups"), real.get("skipped_groups")
    (group,) = real["groups"]
    assert group["model"] == "lstm" and group["batch"] == 1
    assert group["ratio"]["eager"]["median"] == pytest.approx(1.0)
    assert group["skipped"]["compile"] == "left out (--no-compile)"
    for label, stats in group["time_s"].items():
        assert stats["n"] == real["rounds"] and stats["q1"] <= stats["median"] <= stats["q3"], label
    assert any(k.startswith("opsched:") for k in group["time_s"]), group["skipped"]
    assert all(v.startswith("ok") for v in group["outputs"].values()), group["outputs"]
    assert group["load"]["rounds"] == real["rounds"]
    # 4: no profiles, so no fitted planning model: a stated reason, not a NaN row
    assert "opsched profile" in res["sections"]["fidelity"]["skipped"]

    report = (out / "report.md").read_text()
    assert report.startswith("# opsched benchmark report")
    head = report.index("## Headline")
    assert report.index("| model | batch |") > head and "## 1. Real execution" in report
    assert "## 4. Fidelity" in report and "skipped: no usable profile" in report
    headline = report[head:report.index("## 1. Real execution")]
    assert "Largest gap" in headline or "narrowest lead" in headline  # opsched behind, or ahead on every row
    assert not re.search(r"\bnan\b", report, re.IGNORECASE)
    assert (out / "real_ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](real_ratios.png)" in report
    assert not (out / "fidelity.png").exists() and "](fidelity.png)" not in report


def _main_unpinned(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)`` of a benchmark that pins its process to one core, the
    suite's CPUs given back after."""
    import os

    cpus = os.sched_getaffinity(0)
    try:
        return main(argv)
    finally:
        os.sched_setaffinity(0, cpus)


def test_plan_search_and_teacher_cpsat_write_their_figures(tmp_path: Path) -> None:
    """The two benchmarks behind the planning defaults write JSON and markdown
    with a row per configuration they compared."""
    import json

    pytest.importorskip("ortools")
    from opsched.benchmarks import plan_search, teacher_cpsat

    assert _main_unpinned(plan_search.main, ["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "plan_search.json").read_text())
    assert set(res["configs"]) == {plan_search._key(*c) for c in plan_search.QUICK_GRID}
    assert all(c["median_ms"] > 0 and c["gmean"] > 0 for c in res["configs"].values())
    assert set(res["greedy_by_prior_scale"]) == {"1.0", "10.0"} and (tmp_path / "plan_search.md").is_file()
    assert teacher_cpsat.main(["--pairs", "2", "--cpsat", "0.1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "teacher_cpsat.json").read_text())
    assert set(res["summary"]) == {"0.0", "0.1"} and res["summary"]["0.1"]["gmean"] <= 1.0 + 1e-9


def test_hint_choice_writes_a_ratio_per_variant_and_pair(tmp_path: Path, monkeypatch) -> None:
    """The hint-choice benchmark (issue 23, docs/learning.md): per pair, every
    variant's greedy makespan over the best baseline's, and the hint each used."""
    import json

    from opsched.benchmarks import hint_choice

    pairs = hint_choice.pairs_of("val", None)[:2]
    monkeypatch.setattr(hint_choice, "pairs_of", lambda split, group, max_nodes=128: pairs)
    assert hint_choice.main(["--split", "val", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "hint_choice_val.json").read_text())
    assert len(res["rows"]) == 2 and set(res["summary"]) == {"validation", "all"}
    for row in res["rows"]:
        assert all(row[v] > 0.5 for v in hint_choice.VARIANTS)  # a ratio to the best baseline, not a time
        assert row["orig+cpa_hint"] in ("cpa", row["orig_hint"])  # adding CPA can only make CPA the best
        assert row["orig+budget_hint"] in ("bicpa", "lp-rounding", row["orig_hint"])
    # the first validation pair (inception, 308 ops, on a CPU-only machine) gets biCPA and LP rounding as hints
    assert res["rows"][0]["slot+budget_hint"] in ("bicpa", "lp-rounding")
    assert res["rows"][0]["slot+budget"] < res["rows"][0]["slot"]
    assert res["summary"]["all"]["orig"]["gmean"] == pytest.approx(
        geomean(r["orig"] for r in res["rows"]))


def test_greedy_order_writes_each_orders_ratio_and_puts_the_shipped_rule_back(tmp_path: Path, monkeypatch) -> None:
    """The dispatch-order benchmark (issue 23, docs/learning.md): per pair, each order's
    greedy makespan over the best baseline's; ``faster`` is never worse than the episode's
    or the hint's order, and the shipped rule is in place afterwards."""
    import json

    from opsched.benchmarks import greedy_order, hint_choice
    from opsched.engine import slots

    pairs = [("train-coarse", "layered:200:901", "knl-68"), *hint_choice.pairs_of("val", None)[:1]]
    monkeypatch.setattr(hint_choice, "pairs_of", lambda split, group, max_nodes=128: pairs)
    shipped = slots.faster_order
    assert greedy_order.main(["--split", "val", "--out", str(tmp_path)]) == 0
    assert slots.faster_order is shipped
    res = json.loads((tmp_path / "greedy_order_val.json").read_text())
    assert (tmp_path / "greedy_order_val.md").read_text().startswith("# Greedy decoding's dispatch order")
    assert len(res["rows"]) == 2 and res["summary"]["pairs"] == 2
    for row in res["rows"]:
        assert all(row[v] > 0.5 for v in greedy_order.VARIANTS)  # a ratio to the best baseline, not a time
        assert row["faster"] <= min(row["episode"], row["hint"]) * (1 + 1e-9)
    first = res["rows"][0]  # coarsened: the hint's order is the faster there (1.0105 -> 1.000)
    assert first["order"] == "hint" and first["faster"] < first["episode"]
    assert res["summary"]["faster"]["better"] >= 1 and res["summary"]["faster"]["worse"] == 0
    with pytest.raises(ValueError, match="unknown variant"):
        with greedy_order.order_variant("random"):
            pass


def test_hint_cost_times_both_hint_rules_and_restores_the_shipped_one(tmp_path: Path, monkeypatch) -> None:
    """``hint_choice --cost``: slot_hint's planning time against the fastest plan as the hint."""
    import json

    from opsched.benchmarks import harness, hint_choice
    from opsched.policies import hints

    monkeypatch.setattr(harness, "pin_one_core", lambda: "not pinned (test)")
    monkeypatch.setattr(hint_choice, "COST_CASES", (("layered:30:1", "knl-68"),))
    shipped = hints.slot_hint
    assert hint_choice.main(["--cost", "--out", str(tmp_path)]) == 0
    assert hints.slot_hint is shipped
    res = json.loads((tmp_path / "hint_cost.json").read_text())
    assert set(res["cases"]) == {"layered:30:1@knl-68"} and res["repeats"] == 7
    assert all(v > 0 for v in res["median_ms"].values())
    assert res["ratio"] == pytest.approx(res["median_ms"]["slot_hint"] / res["median_ms"]["fastest"])


def test_omp_teams_writes_every_configuration_and_leaves_no_worker(tmp_path: Path) -> None:
    """``bench/omp_teams.py``: eager's step with and without a second OpenMP team, both pools closed after."""
    import threading

    from opsched.benchmarks import omp_teams

    assert omp_teams.main(["--model", "lstm", "--batch", "1", "--rounds", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "omp_teams.json").read_text())
    assert set(res["rows"]) == {"eager", "eager after co-run, retired", "eager after co-run, kept",
                                "co-run plan, retired", "co-run plan, kept"}
    assert all(math.isfinite(r["median_ms"]) and r["median_ms"] > 0 for r in res["rows"].values())
    assert res["rows"]["eager"]["over_eager"] == 1.0 and "| eager after co-run, kept |" in (
        tmp_path / "omp_teams.md").read_text()
    for t in threading.enumerate():
        if t.name.startswith("omp-teams"):
            t.join(10)
    assert not [t for t in threading.enumerate() if t.name.startswith("omp-teams")]


def test_plan_budget_writes_quality_steps_and_time_per_fill(tmp_path: Path, monkeypatch) -> None:
    """The benchmark behind the default ``fill`` (docs/learning.md): per fill, the
    selection sets' ratios and local-search steps, and planning time per size."""
    import json

    from opsched.benchmarks import plan_budget

    sets = {"validation": [("layered:30:3", "knl-68")], "hard (training pairs)": [("fork_join:26:11", "hard:slow-links:11")]}
    monkeypatch.setattr(plan_budget, "selection_pairs", lambda: sets)
    large = [("layered:230:3", "xeon-8180-2s"), ("layered:230:3", "dgx1-4v100")]
    monkeypatch.setattr(plan_budget, "large_pairs", lambda budget_ops: large * 8)  # --quick keeps every 15th
    assert _main_unpinned(plan_budget.main, ["--quick", "--seeds", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "plan_budget.json").read_text())
    assert set(res["quality"]) == set(sets) and set(res["planning_ms"]) == {"0.0", "0.7"}
    assert res["seeds"] == [0, 1]
    for q in res["quality"].values():
        assert q["0.0"]["steps"] == [res["refine"]]  # fill 0: exactly R steps
        assert q["0.7"]["steps"][0] > res["refine"]  # a 26-30-op graph spends its spare budget
        assert all(r > 0.5 for f in q.values() for r in f["ratios"])
        for f in q.values():  # one gmean per plan seed; the table's figures are seed 0's
            assert len(f["seed_gmeans"]) == 2 and f["seed_gmeans"][0] == pytest.approx(f["gmean"])
    assert "### Plan seeds (2)" in (tmp_path / "plan_budget.md").read_text()
    assert all(v["median_ms"] > 0 for f in res["planning_ms"].values() for v in f.values())
    assert "| 0.7 |" in (tmp_path / "plan_budget.md").read_text()
    rows = res["large"]["rows"]
    assert [(r["graph"], r["machine"]) for r in rows] == large
    cpu, gpu = rows
    assert 0.5 < cpu["True"]["ratio"] <= 1 + 1e-9 and cpu["False"]["ms"] > 0  # every baseline a candidate
    assert gpu["True"]["ratio"] == gpu["False"]["ratio"]  # no LP rounding on a machine with GPUs: the same plan
    assert set(res["large"]) == {"rows", "cpu-only", "with GPUs", "all"}
    assert "| cpu-only | 1 |" in (tmp_path / "plan_budget.md").read_text()


def test_plan_budget_prices_a_step_at_the_cost_asked_and_puts_the_shipped_one_back(tmp_path: Path, monkeypatch) -> None:
    """``--step-cost``: a candidate cost of a local-search step for one run (cheaper: more
    steps on a small graph), recorded in the report beside the shipped one, which is
    restored afterwards; ``--no-large`` plans no graph above the budget graph."""
    import json

    from opsched.benchmarks import plan_budget
    from opsched.policies import budget

    shipped = budget.STEP_COST
    sets = {"validation": [("layered:30:3", "knl-68")]}
    monkeypatch.setattr(plan_budget, "selection_pairs", lambda: sets)
    monkeypatch.setattr(plan_budget, "large_pairs", lambda budget_ops: pytest.fail("--no-large planned a large graph"))
    steps = {}
    for cost in (shipped, shipped / 3):
        out = tmp_path / str(cost)
        argv = ["--quick", "--fills", "0.7", "--step-cost", str(cost), "--no-large", "--out", str(out)]
        assert _main_unpinned(plan_budget.main, argv) == 0
        res = json.loads((out / "plan_budget.json").read_text())
        assert res["step_cost"] == cost and res["shipped_step_cost"] == shipped == budget.STEP_COST
        assert res["large"] == {"rows": []} and "larger than the budget graph" not in (out / "plan_budget.md").read_text()
        steps[cost] = res["quality"]["validation"]["0.7"]["steps"][0]
    assert steps[shipped / 3] > steps[shipped]
    assert f"(shipped: {shipped:g})" in (tmp_path / str(shipped / 3) / "plan_budget.md").read_text()


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--fills", "0,x"], ["--fills", "1.5"], ["--step-cost", "0"]])
def test_plan_budget_rejects_bad_seeds_and_fills(argv: list[str], tmp_path: Path) -> None:
    from opsched.benchmarks import plan_budget

    with pytest.raises(SystemExit) as exc:
        _main_unpinned(plan_budget.main, [*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not list(tmp_path.iterdir())  # nothing written


def test_learned_planning_speed_pins_one_core_and_puts_the_affinity_back() -> None:
    """bench/learned.py's planning time: six 200-op cases on one pinned core, then the
    process may use its CPUs again (the benchmark goes on after it)."""
    import os

    from opsched.benchmarks.learned import planning_speed
    from opsched.policies.exported import load, pretrained_path

    before = os.sched_getaffinity(0)
    res = planning_speed(load(pretrained_path()), repeats=1)
    assert os.sched_getaffinity(0) == before
    pairs = {k: v for k, v in res.items() if "@" in k}
    assert len(pairs) == 6 and all(v > 0 for v in pairs.values())
    assert res["median_s"] == pytest.approx(sorted(pairs.values())[2:4][0] / 2 + sorted(pairs.values())[2:4][1] / 2)
    assert res["pinned"].startswith(("pinned to CPU", "not pinned"))


def test_learned_planning_only_writes_the_planning_figures_per_machine(tmp_path: Path) -> None:
    """``bench/learned.py --planning-only 1``: one round of the 200-op planning time, per machine
    in the report, and nothing else of the bench."""
    from opsched.benchmarks import learned

    assert learned.main(["--planning-only", "1", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planning_speed.json", "planning_speed.md"]
    (r,) = json.loads((tmp_path / "planning_speed.json").read_text())["rounds"]
    assert r["median_s"] > 0 and len([k for k in r if "@" in k]) == 6
    text = (tmp_path / "planning_speed.md").read_text()
    assert "knl-68 " in text and "dgx1-4v100 " in text and "| 0 |" in text
    with pytest.raises(SystemExit):
        learned.main(["--planning-only", "-1", "--out", str(tmp_path)])


def test_learned_reports_how_often_the_greedy_decoding_kept_its_hint(tmp_path: Path) -> None:
    """bench/learned.py's rows count the greedy decoding's slots that took the hint's
    decision, and the report gives each group's share."""
    from opsched.benchmarks.learned import evaluate, summarise, write_markdown
    from opsched.policies.exported import load, pretrained_path

    rows = evaluate(load(pretrained_path()), [("cpu", "layered:30:904", "knl-68"),
                                              ("gpu", "erdos_renyi:150:902", "dgx1-4v100")], ks=(0,))
    assert [r["greedy_hint_kept"][1] for r in rows] == [30, 128]  # every slot, coarsened or not
    assert all(0 <= kept <= n for kept, n in (r["greedy_hint_kept"] for r in rows))
    summary = summarise(rows, 0)
    assert summary["all"]["hint_kept"] == pytest.approx(
        sum(r["greedy_hint_kept"][0] for r in rows) / 158)
    res = {"summary": summary, "rows": rows, "policy": "p", "command": "c", "host": {"host": "h", "cpu_count": 2},
           "load_start": (0, 0, 0), "load_end": (0, 0, 0), "seconds": 1.0, "default_k": 0, "refine": 10}
    write_markdown(res, tmp_path / "learned.md")
    text = (tmp_path / "learned.md").read_text()
    assert "| hint kept |" in text and f"| {summary['all']['hint_kept']:.3f} |" in text
    from opsched.policies.hints import hint_names

    # the hint of each pair is named: on the 30-op graph a heuristic the default search adds may be it
    assert all(r["greedy_hint"] in (*hint_names(), "lp-rounding") for r in rows)
    assert all(f"| {r['best_heuristic']} | {r['greedy_hint']} |" in text for r in rows)


def test_rejected_variants_write_their_figures_and_put_the_planner_back(tmp_path: Path, monkeypatch) -> None:
    """``bench/rejected.py``: each variant changes what it says while it runs (biCPA among
    a 30-op CPU graph's spare-budget candidates; the local search's moves), no plan
    beats CP-SAT's proven bound, and the shipped planner is back afterwards."""
    from opsched.benchmarks import rejected
    from opsched.policies import budget, exported, refine

    shipped = (exported.search_budget, budget.hint_extra, refine.local_search, refine._move)
    assert rejected.bicpa_budget(30, False, 10, 0.7, 200).extra == ("lp-rounding", "bicpa")
    assert rejected.bicpa_budget(30, False, 10, 0.7, 200).steps < budget.search_budget(30, False, 10, 0.7, 200).steps
    assert rejected.bicpa_budget(180, False, 10, 0.7, 200) == budget.search_budget(180, False, 10, 0.7, 200)  # neither fits
    with rejected.bicpa_variant(True):
        assert "bicpa" in budget.hint_extra(30, 128, False) and exported.search_budget is rejected.bicpa_budget
    sets = {"validation": [("layered:30:3", "knl-68"), ("zoo:inception@1x0.5", "knl-68")]}
    monkeypatch.setattr(rejected, "bicpa_pairs", lambda: sets)
    assert rejected.main(["--what", "bicpa", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rejected_bicpa.json").read_text())
    assert [r["graph"] for r in res["rows"]] == ["layered:30:3"]  # the coarsened graph is skipped
    row = res["rows"][0]
    assert row["bicpa_default"] <= 1 + 1e-9  # every baseline is then a candidate: never slower than the best
    assert row["shipped_default"] > 0 and row["bicpa_hint"] in {"bicpa", "lp-rounding", *exported.load(
        exported.pretrained_path()).hints}
    assert len(row["shipped_ms"]) == len(row["bicpa_ms"]) == 2
    assert "| validation | 1 |" in (tmp_path / "rejected_bicpa.md").read_text()
    assert rejected.main(["--what", "moves", "--quick", "--cpsat-s", "0.5", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rejected_moves.json").read_text())
    assert len(res["rows"]) == 2
    for r in res["rows"]:
        for name in ("heuristic", *rejected.MOVE_VARIANTS):
            assert r[f"{name}_s"] >= r["lower_bound_s"] * (1 - 1e-9)
    assert (exported.search_budget, budget.hint_extra, refine.local_search, refine._move) == shipped
    with pytest.raises(ValueError, match="unknown move variant"), rejected.move_variant("swap"):
        pass


def test_rejected_hint_order_follows_the_hint_order_and_puts_the_decoder_back(tmp_path: Path, monkeypatch) -> None:
    """``--what hint-order``: the variant's decoding finishes every op and keeps hinted
    decisions, it is the planner's decoder only while it runs (the shipped one is back
    afterwards), and the figures land in both files."""
    from opsched.benchmarks import rejected
    from opsched.engine.observe import prepare_episode
    from opsched.engine.slots import from_episode
    from opsched.machine import get_machine
    from opsched.policies import exported
    from opsched.policies.hints import best_heuristic
    from opsched.specs import load_graph

    shipped = exported.decode_episode
    policy = exported.load(exported.pretrained_path())
    g, m = load_graph("layered:20:7"), get_machine("cpu:4:50:10000")
    data = prepare_episode(g, m, None, policy.max_nodes, policy.max_edges, best_heuristic(g, m)[1])
    ep, _, _ = rejected.hint_order_episode(policy.encoder, data, prior_scale=10.0)
    sp, hint = from_episode(ep), data.hint_follow.slots
    followed = [i for i in range(data.n) if (sp.device[i], sp.level[i]) == (hint.device[i], hint.level[i])]
    assert ep.done and sorted(ep.order) == list(range(data.n)) and followed
    with rejected.hint_order_variant(True):
        assert exported.decode_episode is not shipped
    assert exported.decode_episode is shipped
    sets = {"validation": [("layered:30:3", "knl-68")], "train-coarse": []}
    monkeypatch.setattr(rejected, "hint_order_pairs", lambda: sets)
    assert rejected.main(["--what", "hint-order", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rejected_hint-order.json").read_text())
    assert [r["graph"] for r in res["rows"]] == ["layered:30:3"] and list(res["summary"]) == ["validation"]
    assert all(r[t] > 0 for r in res["rows"] for t in ("shipped", "order"))
    assert "| validation | 1 |" in (tmp_path / "rejected_hint-order.md").read_text()
    assert exported.decode_episode is shipped


def test_coarse_budget_compares_its_rules_and_puts_the_budget_back(tmp_path: Path, monkeypatch) -> None:
    """``bench/coarse_budget.py``: each rule is in force while it runs (LP rounding a candidate of a
    coarsened CPU graph or not, the steps it costs), the figures land in both files, and the
    shipped rule is back afterwards."""
    from opsched.benchmarks import coarse_budget
    from opsched.policies import budget

    shipped = (budget.COARSE_EXTRA, budget.COARSE_STEPS)
    with coarse_budget.rule("before"):
        assert budget.search_budget(200, False, 10, 0.7, 200, True, True) == budget.SearchBudget(10)
    with coarse_budget.rule("lp"):
        assert budget.search_budget(200, False, 10, 0.7, 200, True, True).extra == ("lp-rounding",)
        assert budget.COARSE_STEPS < shipped[1]
    with coarse_budget.rule("lp+bicpa"):  # the shipped rule
        assert budget.search_budget(200, False, 10, 0.7, 200, True, True).extra == ("lp-rounding", "bicpa")
        assert budget.COARSE_STEPS == shipped[1]
    assert (budget.COARSE_EXTRA, budget.COARSE_STEPS) == shipped
    monkeypatch.setattr(coarse_budget, "pairs", lambda quick=False: [("layered:140:4105", "random:9")])
    assert coarse_budget.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "coarse_budget.json").read_text())
    (row,) = res["rows"]
    assert row["ops"] == 140 and row["before_steps"] == 10 and row["lp_steps"] == 0
    for name in coarse_budget.RULES:
        assert row[f"{name}_default"] > 0 and len(row[f"{name}_ms"]) == 2
    assert row["lp+bicpa_steps"] == 0 and row["lp_hint"] and row["before_hint"]
    assert "| lp |" in (tmp_path / "coarse_budget.md").read_text()
    assert (budget.COARSE_EXTRA, budget.COARSE_STEPS) == shipped
    from opsched.benchmarks import hint_choice
    from opsched.policies import hints

    monkeypatch.setattr(hint_choice, "pairs_of", lambda *a: [("train-coarse", "layered:140:4105", "random:9")])
    assert coarse_budget.main(["--train-coarse", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "coarse_budget_train.json").read_text())
    (row,) = res["rows"]
    assert row["apart_greedy"] > 0 and row["bounded_greedy"] > 0 and res["hints_changed"] in (0, 1)
    assert hints.EXTRAS_APART is True


def test_moldable_speed_times_the_same_allocations_both_ways(tmp_path: Path) -> None:
    """``bench/moldable_speed.py``: the old per-cap loop and the one-pass allocations agree on
    every row it times, and the figures land in both files."""
    from opsched.benchmarks import moldable_speed

    assert moldable_speed.main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "moldable_speed.json").read_text())
    assert len(res["rows"]) == 2 and res["all_same"]
    for r in res["rows"]:
        assert r["per_cap_ms"] > 0 and r["one_pass_ms"] > 0 and r["bicpa_ms"] > 0
    assert "| erdos_renyi:150:5 | xeon-8180-2s |" in (tmp_path / "moldable_speed.md").read_text()
    with pytest.raises(SystemExit):
        moldable_speed.main(["--repeats", "0", "--out", str(tmp_path)])


def test_replay_speed_compares_both_replays_on_the_same_plans_and_puts_the_gate_back(tmp_path: Path) -> None:
    """``bench/replay_speed.py``: the three replays plan every case it times to the same makespan,
    the figures land in both files, and the shipped gate and compiled loop are back afterwards."""
    import opsched.engine.fast_replay as fast
    import opsched.engine.sim as sim
    from opsched.benchmarks import replay_speed
    from opsched.engine.fast_replay import supports

    compiled = fast._compiled()
    res = replay_speed.run(1, (("erdos_renyi:25:951", "cpu:4:50:10000"),), python=True)
    assert sim.supports_fast is supports and fast._compiled() is compiled
    assert res["all_same_plan"] and len(res["rows"]) == 1
    row = res["rows"][0]
    assert row["compiled_ms"] > 0 and row["python_ms"] > 0 and row["general_ms"] > 0 and row["same_plan"]
    assert "| erdos_renyi:25:951 | cpu:4:50:10000 | 25 |" in replay_speed.markdown(res)
    assert "| compiled ms | general ms | python ms | compiled / general | python / general |" in \
        replay_speed.markdown(res)
    with pytest.raises(SystemExit):
        replay_speed.main(["--repeats", "0", "--out", str(tmp_path)])
    assert replay_speed.main(["--repeats", "1", "--cases", "1", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "replay_speed.json").read_text())["rows"][0]["graph"] == "layered:200:911"
    assert (tmp_path / "replay_speed.md").exists()


def test_budget_costs_measures_each_part_per_op_and_writes_its_report(tmp_path: Path) -> None:
    """``python -m opsched.benchmarks.budget_costs``: per case the base planning cost per op,
    a local-search step's and LP rounding's and biCPA's in op units (positive where they ran),
    the medians per machine kind, and the shipped constants beside them in the report."""
    from opsched.benchmarks import budget_costs
    from opsched.policies.budget import STEP_COST

    res = budget_costs.run((25,), ("layered",), ("knl-68",), repeats=1)
    (row,) = res["rows"]
    assert row["ops"] == 25 and row["base_ms_per_op"] > 0 and row["step_us_per_op"] >= 0
    assert row["lp-rounding_units"] > 0 and row["bicpa_units"] > 0
    assert row["step_units"] == pytest.approx(row["step_us_per_op"] * 1e-3 / row["base_ms_per_op"])
    assert set(res["kinds"]) == {"cpu-only"} and res["shipped"]["STEP_COST"] == STEP_COST
    text = budget_costs.markdown(res)
    assert "| layered:25 | knl-68 | 25 |" in text and f"a step {STEP_COST} units" in text
    with pytest.raises(SystemExit):
        budget_costs.main(["--repeats", "0", "--out", str(tmp_path)])


def test_learned_counts_a_policy_win_only_where_its_plan_beats_every_heuristic() -> None:
    """A greedy plan that only ties the best heuristic's (it followed its hint everywhere) is
    no win in bench/learned.py's count; a refined plan that is faster is, a heuristic's is not."""
    from opsched.benchmarks.learned import summarise

    def row(chosen: str, span: float) -> dict:
        return {"group": "cpu", "greedy_s": 1.0, "best_s": 1.0, "no_refine_s": 1.0, "greedy_hint_kept": (1, 1),
                "k": {"0": {"makespan_s": span, "chosen": chosen, "plan_s": 0.01}}}

    rows = [row("greedy", 1.0), row("refined(greedy)", 0.9), row("heuristic:heft", 1.0), row("sample-0", 0.99)]
    s = summarise(rows, 0)
    assert s["cpu"]["policy_chosen"] == s["all"]["policy_chosen"] == 2


def test_budget_free_writes_both_variants_and_puts_the_shipped_budget_back(tmp_path: Path) -> None:
    """``bench/budget_free.py``: per pair the search with and without biCPA as the free extra
    (without it no plan has biCPA among its candidates), its files, and the shipped budget after."""
    import json

    from opsched.benchmarks import budget_free
    from opsched.policies import budget

    with budget_free.free_extra(False):
        assert "bicpa" not in budget.search_budget(40, False, 10, 0.7, 200).extra
    assert budget.BUDGET_FREE_EXTRA == "bicpa"
    assert budget_free.main(["--quick", "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert budget.BUDGET_FREE_EXTRA == "bicpa"
    res = json.loads((tmp_path / "budget_free.json").read_text())
    assert {r["set"] for r in res["rows"]} == {"validation", "hard (training pairs)", "training synthetic"}
    for r in res["rows"]:
        assert len(r["shipped_default"]) == len(r["without_default"]) == 1
        assert r["shipped_bicpa"] == ("bicpa" in budget.search_budget(r["ops"], r["gpus"] > 0, 10, 0.7, 200).extra)
    assert "| validation |" in (tmp_path / "budget_free.md").read_text()


def test_step_cost_plans_at_each_price_and_puts_the_shipped_price_back(tmp_path: Path) -> None:
    """``python -m opsched.benchmarks.step_cost``: per pair and price the default search's makespan
    and steps (a cheaper step buys more of them, from the same seed, so never a worse plan), its
    files, and the shipped price after."""
    import json

    from opsched.benchmarks import step_cost
    from opsched.policies import budget

    shipped = budget.STEP_COST
    assert step_cost.main(["--quick", "--seeds", "1", "--costs", "0.005,0.002", "--out", str(tmp_path)]) == 0
    assert budget.STEP_COST == shipped
    res = json.loads((tmp_path / "step_cost.json").read_text())
    assert {r["set"] for r in res["rows"]} == {"validation", "hard (training pairs)", "training synthetic"}
    for r in res["rows"]:
        assert r["c0.002_steps"] >= r["c0.005_steps"] >= 10
        assert r["c0.002_default"][0] <= r["c0.005_default"][0] * (1 + 1e-9)
    assert any(r["c0.002_steps"] > r["c0.005_steps"] for r in res["rows"])
    assert "| validation |" in (tmp_path / "step_cost.md").read_text()
    with pytest.raises(SystemExit):
        step_cost.main(["--costs", "0.005,abc", "--out", str(tmp_path)])


def test_the_corun_move_puts_two_independent_ops_side_by_side_at_half_width() -> None:
    """``rejected --what moves``'s ``corun`` variant: two ops neither of which reaches the
    other, on one device, both at the largest level of at most half its cores, dispatched
    one right after the other without holds; the ranks stay a permutation."""
    import numpy as np

    from opsched.benchmarks.rejected import _corun_move, _independent
    from opsched.engine.observe import prepare_episode
    from opsched.engine.slots import from_plan
    from opsched.machine import get_machine
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    g, m = generate("layered", 20, 2), get_machine("cpu:4:50:10000")
    data = prepare_episode(g, m, None, 128, 1024)
    sp = from_plan(data, get_policy("critical-path-first").plan(g, m), "cpf")
    move = _corun_move(lambda *_: None)
    rng = np.random.default_rng(0)
    seen = 0
    for _ in range(200):
        out = move(data, sp, rng)
        if out is None:
            continue
        seen += 1
        assert sorted(out.rank) == list(range(data.n))
        i, j = out.meta["corun"]
        assert _independent(data)[i, j] and out.device[i] == out.device[j]
        assert out.rank[j] == out.rank[i] + 1 and out.after[i] == out.after[j] == ()
        assert data.static.levels[out.device[i]][out.level[i]] == 2 == data.static.levels[out.device[j]][out.level[j]]
        moved = [k for k in range(data.n) if out.rank[k] != sp.rank[k] and k not in (i, j)]
        assert all(out.rank[k] == sp.rank[k] + 1 for k in moved)  # the ops between shift down one
    assert seen > 0
