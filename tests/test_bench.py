"""Smoke test of ``bench/run_all.py`` (issue 9): a ``--quick`` run into a temporary
folder writes the report, the raw figures and the PNGs with the right structure.

It checks presence and structure only -- never a timing.  One zoo model, no
``torch.compile`` and no TensorFlow section keep it near two minutes on a
shared 2-core machine; the full ``--quick`` (what CI's benchmark job runs) adds those.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import _harness as H  # noqa: E402
from _report import headline  # noqa: E402


def test_round_ratios_pair_rounds_and_report_spread() -> None:
    samples = {"eager": [2.0, 4.0, 2.0], "fast": [1.0, 2.0, 1.0], "slow": [4.0, 8.0, 6.0]}
    r = H.round_ratios(samples, "eager")
    assert r["eager"]["median"] == 1.0
    assert r["fast"]["median"] == pytest.approx(0.5) and r["fast"]["q1"] == r["fast"]["q3"] == pytest.approx(0.5)
    assert r["slow"]["median"] == pytest.approx(2.0) and r["slow"]["max"] == pytest.approx(3.0)
    assert H.stats([])["n"] == 0
    assert H.geomean([1.0, 4.0]) == pytest.approx(2.0)


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
    from run_all import train_time_to_beat_cpf

    assert "skipped" in train_time_to_beat_cpf(tmp_path)
    run = tmp_path / "ppo_1"
    run.mkdir()
    (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n5000,60,1.20\n10000,120,0.98\n15000,180,0.95\n")
    (run / "command.txt").write_text("opsched train-policy\n")
    r = train_time_to_beat_cpf(tmp_path)
    assert r["beat_cpf"] and r["steps"] == 10000 and r["wall_s"] == 120 and r["command"] == "opsched train-policy"
    (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n5000,60,1.20\n")
    r = train_time_to_beat_cpf(tmp_path)
    assert r["beat_cpf"] is False and r["final_gmean_cpf"] == 1.2


def test_train_time_to_beat_cpf_prefers_a_run_of_todays_default(tmp_path: Path) -> None:
    """A run counts as default by the hyperparameters it resolved to, not by
    its entry's name: one made under an older default is passed over."""
    import os

    import yaml
    from run_all import train_time_to_beat_cpf

    from opsched.agents.config import load_hyperparams

    current = load_hyperparams("default")
    for name, ppo, mtime in (("ppo_1", current, 1_000), ("ppo_2", {**current, "rounds": 99}, 2_000)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"hyperparams": "default", "seed": 0, "ppo": ppo}))
        (run / "evaluations.csv").write_text("timesteps,wall_s,gmean_cpf\n0,40,0.99\n")
        os.utime(run / "evaluations.csv", (mtime, mtime))
    assert train_time_to_beat_cpf(tmp_path)["run"].endswith("ppo_1")


def test_cli_wrapper_registers() -> None:
    from typer.testing import CliRunner

    import opsched.commands.bench  # noqa: F401  (registers `opsched bench`)
    from opsched.cli import app

    res = CliRunner().invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "--quick" in res.output


@pytest.mark.slow
def test_quick_run_writes_report_results_and_figures(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "bench" / "run_all.py"), "--quick", "--out", str(tmp_path), "--models", "lstm",
           "--no-compile", "--sections", "real,sim,costs,fidelity", "--search-trials", "3", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(tmp_path.glob("bench_[0-9]*"))
    assert len(runs) == 1
    out = runs[0]
    for name in ("report.md", "results.json", "command.txt", "machine.json", "versions.json"):
        assert (out / name).is_file(), name
    assert "run_all.py --quick" in (out / "command.txt").read_text()
    res = json.loads((out / "results.json").read_text())
    assert res["quick"] is True and set(res["sections"]) == {"real", "sim", "costs", "fidelity"}
    assert res["versions"]["torch"] and isinstance(res["machine"]["opsched_machine"], dict)

    # 1: the eager reference and the ratios to it, for every configuration that ran
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
    # 2: every preset x graph x policy, each row with its lower-bound ratio
    sim = res["sections"]["sim"]
    assert sim["rows"] and all(r["lb_ratio"] >= 1.0 - 1e-9 for r in sim["rows"])
    assert {r["policy"] for r in sim["rows"]} >= {"sequential", "critical-path-first", "search"}
    # 3 and 4: figures or a stated reason, never nothing
    costs = res["sections"]["costs"]
    for key in ("runtime_overhead", "sim_speed", "env_speed", "train_to_beat_cpf"):
        assert "skipped" in costs[key] or costs[key], key
    assert costs["planning"]["rows"]
    fid = res["sections"]["fidelity"]
    assert fid["rows"] or fid["skipped"]

    report = (out / "report.md").read_text()
    assert report.startswith("# opsched benchmark report")
    head = report.index("## Headline")
    assert report.index("| model | batch |") > head and "## 1. Real execution" in report
    assert "## 2. Scale in the simulator" in report and "## 3. Costs" in report and "## 4. Fidelity" in report
    assert "gap" in report[head:report.index("## 1. Real execution")]
    figures = ["real_ratios.png", "sim_scale.png", "planning_time.png"] + (["fidelity.png"] if fid["rows"] else [])
    for png in figures:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report, png
