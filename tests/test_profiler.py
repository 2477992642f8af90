"""The per-op profiler: real measurements of a tiny torch model, the JSON cache, co-run pairs."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from torch import nn

from opsched.backends import interference as itf
from opsched.backends import profiler
from opsched.backends.profiler import profile_graph, usable_cores
from opsched.engine.models import interference as itm
from opsched.engine.profiles import Profile, ProfileError, cache_path
from opsched.errors import OpschedError
from opsched.importers.torch_fx import from_torch
from opsched.machine import Machine

LEVELS = (1, 2) if usable_cores() >= 2 else (1,)
FAST = dict(warmup=1, repeats=3, interference=False, progress=False, threads=LEVELS, max_attempts=1)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.flatten(1)).softmax(-1)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return from_torch(Tiny().eval(), (torch.randn(1, 3, 8, 8),), name="tiny")


@pytest.fixture(scope="module")
def machine():
    return Machine.probe()


def test_profile_measures_every_op_at_every_level(tiny, machine, tmp_path):
    prof = profile_graph(tiny, machine, cache_dir=tmp_path, **FAST)
    assert set(prof.ops) == {op.id for op in tiny.ops}
    assert prof.levels == LEVELS
    assert prof.graph_fingerprint == tiny.fingerprint() and prof.machine_fingerprint == machine.fingerprint()
    for p in prof.ops.values():
        assert set(p.samples) == set(LEVELS)
        for k in LEVELS:
            assert len(p.samples[k]) >= 1 and min(p.samples[k]) > 0  # rounds may be dropped as preempted
            q25, q75 = p.quartiles[k]
            assert q25 <= p.median[k] <= q75
        assert p.others_cores >= 0
    # the op order and the op's features travel with the measurement
    assert prof.ops["conv"].kind == "conv" and prof.ops["conv"].flops == tiny.op("conv").flops


def test_cache_is_written_and_reused_unless_refresh(tiny, machine, tmp_path, monkeypatch):
    calls = []
    real = profiler.time_op
    monkeypatch.setattr(profiler, "time_op", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = profile_graph(tiny, machine, cache_dir=tmp_path, **FAST)
    path = cache_path(tiny, machine, tmp_path)
    assert path.exists() and path.name == f"{tiny.fingerprint()}_{machine.fingerprint()}.json"
    assert len(calls) == len(tiny.ops)
    calls.clear()
    again = profile_graph(tiny, machine, cache_dir=tmp_path, **FAST)
    assert calls == []  # nothing re-measured
    assert again.to_dict() == Profile.load(path).to_dict()
    for op_id, p in first.ops.items():
        # the cache keeps samples in whole nanoseconds: a median moves by at most 0.5 ns
        for k, t in p.median.items():
            assert again.ops[op_id].median[k] == pytest.approx(t, abs=0.5e-9)
    profile_graph(tiny, machine, cache_dir=tmp_path, refresh=True, **FAST)
    assert len(calls) == len(tiny.ops)


def test_json_round_trip(tiny, machine, tmp_path):
    prof = profile_graph(tiny, machine, cache_dir=False, **FAST)
    text = json.dumps(prof.to_dict())
    back = Profile.from_dict(json.loads(text))
    assert back.to_dict() == prof.to_dict()
    assert back.levels == prof.levels and set(back.ops) == set(prof.ops)
    for k, p in prof.ops.items():
        for threads, t in p.median.items():  # samples are kept in whole nanoseconds
            assert back.ops[k].median[threads] == pytest.approx(t, abs=0.5e-9)
        assert back.ops[k].signature == p.signature
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").to_dict() == prof.to_dict()
    bad = {**prof.to_dict(), "interference": {"pairs": [{"a": "x"}]}}
    with pytest.raises(ProfileError, match="malformed profile"):
        Profile.from_dict(bad, where="bad.json")


def test_truncated_cache_is_a_clear_error_and_is_remeasured(tiny, machine, tmp_path):
    profile_graph(tiny, machine, cache_dir=tmp_path, **FAST)
    path = cache_path(tiny, machine, tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="truncated or corrupt") as err:
        Profile.load(path)
    assert str(path) in str(err.value)
    with pytest.warns(UserWarning, match="re-measuring"):
        prof = profile_graph(tiny, machine, cache_dir=tmp_path, **FAST)
    assert set(prof.ops) == {op.id for op in tiny.ops}
    assert Profile.load(path).to_dict() == prof.to_dict()  # the cache is whole again


@pytest.mark.parametrize("data, match", [
    ({"format": "something else"}, "not an opsched profile"),
    ({"format": "opsched.profile", "version": 99}, "version 99"),
    ({"format": "opsched.profile", "version": 1, "ops": [{"id": "a"}]}, "malformed profile"),
    ([1, 2, 3], "not an opsched profile"),
])
def test_bad_profiles_raise_profile_error(tmp_path, data, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=match):
        Profile.load(p)
    with pytest.raises(ProfileError, match="no such profile"):
        Profile.load(tmp_path / "missing.json")


def test_graph_without_source_and_too_many_threads_are_clear_errors(diamond, tiny, machine):
    with pytest.raises(ProfileError, match="no executable PyTorch source"):
        profile_graph(diamond, machine, cache_dir=False, **FAST)
    with pytest.raises(ProfileError, match="cannot measure"):
        profile_graph(tiny, machine, cache_dir=False, progress=False, threads=[usable_cores() + 1])
    assert issubclass(ProfileError, OpschedError)


def test_raising_op_is_named(machine):
    class Bad(nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1

    g = from_torch(Bad(), (torch.randn(4),), name="bad")
    src = g.source
    ops = src.compile_ops()

    def boom(values):
        raise RuntimeError("kaput")

    src._compiled = [type(ops[0])(ops[0].op_id, boom, ops[0].reads, ops[0].writes), *ops[1:]]
    with pytest.raises(ProfileError, match=f"op {ops[0].op_id!r} raised.*kaput"):
        profile_graph(g, machine, cache_dir=False, **FAST)


def test_time_op_sets_thread_counts_and_restores_caller():
    seen: list[int] = []
    before = torch.get_num_threads()
    with profiler._measuring():
        samples, dropped = profiler.time_op(lambda: seen.append(torch.get_num_threads()), LEVELS, warmup=1,
                                            repeats=4)
    assert set(seen) == set(LEVELS)
    for k in LEVELS:  # rounds are kept or dropped whole, at least one is kept
        assert 1 <= len(samples[k]) <= 4 and 0 <= dropped[k] < 4
    assert torch.get_num_threads() == before


@pytest.mark.skipif(usable_cores() < 2, reason="co-running needs two CPUs")
def test_pairs_are_measured_side_by_side():
    a, b = torch.randn(64, 64), torch.randn(32, 32)
    ops = {"mm64": (lambda: a @ a, 2 * 64**3, 3 * 64 * 64 * 4), "add": (lambda: b + b, 0.0, 3 * 32 * 32 * 4)}
    recs = itf.measure_pairs(ops, [("mm64", "add"), ("add", "add")], window_s=0.02, max_attempts=1)
    assert [r.cls for r in recs] == ["mixed", "memory+memory"]
    for r in recs:
        assert min(r.alone_a, r.alone_b, r.corun_a, r.corun_b) > 0
        assert r.demand_a > 0 and all(s > 0 for s in r.slowdowns)
    fit = itm.fit_interference(recs, bandwidth_gbs=10.0)
    assert fit.c0 >= 0 and fit.gamma >= 0 and fit.n_pairs == 2


def test_a_raising_co_runner_raises_and_leaves_no_thread():
    before = threading.active_count()

    def bad():
        raise ValueError("co-runner failed")

    with pytest.raises(ValueError, match="co-runner failed"):
        itf.run_side_by_side([lambda: torch.ones(4) + 1, bad], window_s=0.01)
    assert threading.active_count() == before


def test_choose_pairs_covers_the_classes():
    cands = {"c1": (1e-3, 1e9, 1e6), "c2": (2e-3, 2e9, 1e6), "m1": (1e-3, 0.0, 1e7), "m2": (5e-4, 1e3, 1e7)}
    pairs = itf.choose_pairs(cands)
    classes = {(itm.classify(*cands[a][1:]), itm.classify(*cands[b][1:])) for a, b in pairs}
    assert {("compute", "compute"), ("memory", "memory"), ("compute", "memory")} <= classes


def test_interference_is_stored_in_the_profile(tiny, machine, monkeypatch):
    # Keep it quick: tiny windows and synthetic kernels that fit in cache.
    monkeypatch.setattr(itf, "measure_bandwidth", lambda threads, **k: 10.0 * threads)
    small = {"gemm256": (lambda: torch.ones(8, 8) @ torch.ones(8, 8), 1024.0, 768.0),
             "stream_add": (lambda: torch.ones(64) + 1, 0.0, 768.0)}
    monkeypatch.setattr(itf, "synthetic_kernels", lambda llc=0: small)
    real = itf.measure_pairs
    monkeypatch.setattr(itf, "measure_pairs", lambda *a, **k: real(*a, **{**k, "window_s": 0.01,
                                                                          "max_attempts": 1}))
    prof = profile_graph(tiny, machine, cache_dir=False, warmup=1, repeats=3, progress=False, threads=LEVELS)
    inter = prof.interference
    assert inter is not None and set(inter) >= {"fit", "pairs", "bandwidth_gbs", "class_factors"}
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.interference == json.loads(json.dumps(inter))
    if usable_cores() >= 2:
        assert len(inter["pairs"]) >= 3
        fit = itm.InterferenceFit.from_dict(inter["fit"])
        assert np.all(fit.slowdown([5.0, 5.0]) >= 1.0)


def test_cli_profile_writes_then_reuses_the_cache(tmp_path):
    from typer.testing import CliRunner

    import opsched.commands.profile  # noqa: F401  (registers the command)
    from opsched.cli import app

    model = tmp_path / "tiny_model.py"
    model.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build(batch):\n"
        "    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n"
        "    return m, (torch.randn(batch, 8),)\n"
    )
    args = ["profile", f"{model}:build", "--out", str(tmp_path / "cache"), "--repeats", "2", "--warmup", "0",
            "--threads", "1", "--no-interference", "--top", "3"]
    runner = CliRunner()
    first = runner.invoke(app, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    files = list((tmp_path / "cache").glob("*.json"))
    assert len(files) == 1 and files[0].name in first.output.replace("\n", "")
    assert "speed-up" in first.output and "written" in first.output
    second = runner.invoke(app, args, catch_exceptions=False)
    assert second.exit_code == 0 and "reused" in second.output
    bad = runner.invoke(app, [*args[:-5], "--threads", "one"])
    assert isinstance(bad.exception, OpschedError) and "--threads" in str(bad.exception)
