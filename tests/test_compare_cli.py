"""``opsched compare`` end to end, into a temporary folder: on the simulator,
and for real on this machine's CPU when the torch runtime is available."""

from __future__ import annotations

import csv
import json
import shlex

import pytest
from typer.testing import CliRunner

import opsched.commands.compare  # noqa: F401  (registers the command)
from opsched.cli import app
from opsched.errors import OpschedError
from opsched.policies import heuristic_names

runner = CliRunner()


def _files(run_dir, graphs, policies):
    names = ["command.txt", "results.csv", "results.json", "speedup.png"]
    safe = opsched.commands.compare._safe
    names += [f"gantt/{safe(g)}__{safe(p)}.png" for g in graphs for p in policies]
    return [run_dir / n for n in names]


ALL = [*heuristic_names(), "learned"]  # what --policies all means


def test_compare_on_the_simulator_writes_every_file(tmp_path):
    graphs = ["synthetic:layered:n=30", "synthetic:erdos_renyi:n=25"]
    args = ["compare", "--model", ",".join(graphs), "--machine", "dgx1-4v100", "--backend", "sim",
            "--policies", "all", "--gantt", "all", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "compare_1"
    for path in _files(run_dir, graphs, ALL):
        assert path.is_file() and path.stat().st_size > 0, path
    assert (run_dir / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(run_dir / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == (len(graphs) + 1) * len(ALL)
    per_graph = [r for r in rows if r["graph"] != "geomean"]
    assert {(r["graph"], r["policy"]) for r in per_graph} == {(g, p) for g in graphs for p in ALL}
    for r in per_graph:
        assert float(r["makespan_s"]) > 0 and float(r["decision_s"]) >= 0
        assert float(r["lb_ratio"]) >= 1.0 - 1e-9  # nothing beats the lower bound
        if r["policy"] == "sequential":
            assert float(r["speedup"]) == pytest.approx(1.0)
        else:  # speedup is the sequential makespan over this one
            seq = next(x for x in per_graph if x["graph"] == r["graph"] and x["policy"] == "sequential")
            assert float(r["speedup"]) == pytest.approx(float(seq["makespan_s"]) / float(r["makespan_s"]))
    assert [r["policy"] for r in rows if r["graph"] == "geomean"] == ALL

    data = json.loads((run_dir / "results.json").read_text())
    assert data["config"]["backend"] == "sim" and data["config"]["machine"]["name"] == "dgx1-4v100"
    assert len(data["results"]) == len(rows)
    command = (run_dir / "command.txt").read_text().strip()
    words = shlex.split(command)
    assert words[:2] == ["opsched", "compare"] and ",".join(graphs) in words and "dgx1-4v100" in words
    # a saved plan replays: each policy's plan file is a valid Plan for its graph
    assert len(list((run_dir / "plans").glob("*.json"))) == len(graphs) * len(ALL)

    again = runner.invoke(app, args + ["--gantt", "none", "--policies", "heft"])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "compare_2" / "results.csv").is_file()
    assert not (tmp_path / "compare_2" / "gantt").exists()
    best = runner.invoke(app, args[:-6] + ["--policies", "heft", "--out", str(tmp_path)])  # default: --gantt best
    assert best.exit_code == 0, best.output
    charts = sorted(p.name for p in (tmp_path / "compare_3" / "gantt").glob("*.png"))
    assert 2 <= len(charts) <= 4 and any("sequential" in c for c in charts)  # per graph: the fastest and sequential


@pytest.mark.parametrize("args, match", [
    (["--backend", "torch-cpu", "--machine", "knl-68"], "use --machine local"),
    (["--policies", "nope"], "unknown policy 'nope'"),
    (["--model", "synthetic:nofamily"], "nofamily"),
    (["--repeats", "0"], "--repeats"),
    (["--perf-model", "magic"], "--perf-model must be one of"),
    (["--search-trials", "0"], "--search-trials must be >= 1"),
    (["--backend", "nosuch"], "unknown backend 'nosuch'"),
    (["--gantt", "some"], "--gantt must be one of"),
])
def test_compare_rejects_bad_input(tmp_path, args, match):
    base = {"--model": "synthetic:layered:n=10", "--machine": "knl-68", "--policies": "sequential",
            "--out": str(tmp_path)}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    result = runner.invoke(app, ["compare", *[x for kv in base.items() for x in kv]])
    assert result.exit_code != 0
    assert isinstance(result.exception, OpschedError)
    assert match in str(result.exception)


def _torch_backend_ready() -> bool:
    try:
        import opsched.backends.torch_cpu  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _torch_backend_ready(), reason="the torch CPU runtime is not available")
def test_compare_for_real_on_this_cpu(tmp_path):
    policies = ["sequential", "critical-path-first", "heft"]
    result = runner.invoke(app, [
        "compare", "--model", "zoo:transformer", "--machine", "local", "--backend", "torch-cpu",
        "--policies", ",".join(policies), "--width", "0.25", "--repeats", "3", "--warmup", "1", "--gantt", "all",
        "--out", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "compare_1"
    for path in _files(run_dir, ["zoo:transformer"], policies):
        assert path.is_file(), path
    data = json.loads((run_dir / "results.json").read_text())
    assert data["config"]["repeats"] == 3 and data["config"]["warmup"] == 1
    for p in policies:
        times = data["runs"]["zoo:transformer"][p]["times_s"]
        assert len(times) == 3 and all(t > 0 for t in times)
    rows = [r for r in data["results"] if r["graph"] == "zoo:transformer"]
    for r in rows:
        assert r["min_s"] <= r["makespan_s"] <= r["max_s"]


@pytest.mark.tf
def test_compare_refuses_a_pytorch_graph_on_the_tf_backend_before_writing_anything(tmp_path):
    factory = tmp_path / "net.py"
    factory.write_text("import torch\nfrom torch import nn\n\ndef build(batch):\n"
                       "    return nn.Sequential(nn.Linear(4, 4)), (torch.randn(batch, 4),)\n")
    out = tmp_path / "runs"
    result = runner.invoke(app, ["compare", "--model", f"{factory}:build", "--machine", "local", "--backend", "tf",
                                 "--policies", "sequential", "--out", str(out)])
    assert isinstance(result.exception, OpschedError), result.output
    assert "is a PyTorch model" in str(result.exception) and "--backend torch-cpu" in str(result.exception)
    assert not out.exists() or not any(out.iterdir())  # no half-written run folder


def test_two_exported_policies_keep_their_own_names(tmp_path):
    """Two exported policies are both "learned": the table, the CSV and the
    plan files tell them apart by their folders."""
    import shutil

    from opsched.policies.exported import pretrained_path

    mine = tmp_path / "myrun_3" / "policy"
    shutil.copytree(pretrained_path(), mine)
    args = ["compare", "--model", "synthetic:layered:n=20", "--machine", "xeon-8180-2s", "--backend", "sim",
            "--policies", f"critical-path-first,{mine},{pretrained_path()}", "--gantt", "none", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with open(tmp_path / "compare_1" / "results.csv") as fh:
        names = {r["policy"] for r in csv.DictReader(fh)}
    assert {"learned (myrun_3)", "learned (pretrained)", "critical-path-first"} <= names and "learned" not in names
    plans = {p.name for p in (tmp_path / "compare_1" / "plans").glob("*.json")}
    assert len([p for p in plans if "learned" in p]) == 2
