"""Training steps as a mode of the one apply pipeline (issue 22): ``opsched.train_step``,
``opsched apply --mode train``, ``compare --mode train``, the memory cap and the machine's load.

The capture itself (forward, backward and update as one graph; optimizers; write-back) is
tested in tests/test_train_step_capture.py; here: what a user calls.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_validation import run_cli
from torch import nn

import opsched
from opsched.adapters.base import FallbackReason, ScheduleFallbackWarning
from opsched.adapters.train import TrainStep


class Net(nn.Module):
    """Two branches (room to co-run), BatchNorm (buffers), no conv bias before BN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Conv2d(3, 8, 1)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.fc((self.a(x) + self.b(x)).flatten(1))


def _data(i: int, batch: int = 4):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _eager(module, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(module(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("policy", ["critical-path-first", None])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_train_step_trains_like_eager(policy, opt_name):
    torch.manual_seed(0)
    ours = Net().train()
    ref = copy.deepcopy(ours)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False)}[opt_name]
    opt, opt_ref = make(ours.parameters()), make(ref.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFallbackWarning)
        step = opsched.train_step(policy, ours, F.cross_entropy, opt, *_data(0), backend="torch-cpu", measure=0)
    assert isinstance(step, TrainStep) and step.scheduled, step.fallback_reason
    assert set(step.graph.meta["phases"].values()) == {"forward", "backward", "update"}
    # the check ran on copies: the user's module has not moved yet
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
    for i in range(12):
        x, y = _data(i)
        got, want = step(x, y), _eager(ref, opt_ref, x, y)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (i, float(got), float(want))
    for (k, v), w in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.allclose(v.float(), w.float(), rtol=1e-4, atol=1e-5), k
    assert opt.state_dict()["state"].keys() == opt_ref.state_dict()["state"].keys()


def test_another_shape_runs_the_eager_step_and_says_why():
    torch.manual_seed(1)
    ours = Net().train()
    ref = copy.deepcopy(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, foreach=False)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=False)
    step = opsched.train_step("critical-path-first", ours, F.cross_entropy, opt, *_data(0), measure=0)
    x, y = _data(1, batch=2)
    with pytest.warns(ScheduleFallbackWarning, match="differs from the captured step"):
        got = step(x, y)
    assert torch.allclose(got, _eager(ref, opt_ref, x, y))
    x, y = _data(2)
    assert torch.allclose(step(x, y), _eager(ref, opt_ref, x, y), rtol=1e-4, atol=1e-5)


def test_a_memory_cap_the_plan_exceeds_picks_a_plan_under_it():
    from opsched.engine.sim import Simulator
    from opsched.importers.torch_step import capture_step
    from opsched.machine import Machine
    from opsched.policies import get_policy
    from opsched.scheduled import MemoryCapError, fit_memory

    torch.manual_seed(2)
    net = Net().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, foreach=False)
    g = capture_step(net, F.cross_entropy, opt, *_data(0))
    m = Machine.probe().cpu_only()
    wide = get_policy("critical-path-first").plan(g, m)
    seq = get_policy("sequential").plan(g, m)
    sim = Simulator(m)
    p_wide, p_seq = sim.peak_bytes(g, wide), sim.peak_bytes(g, seq)
    assert p_seq > 0
    keep, _ = fit_memory(g, m, sim.model, wide, None, memory_limit=max(p_wide, p_seq) * 2)
    assert keep is wide
    if p_wide > p_seq:
        out, _ = fit_memory(g, m, sim.model, wide, None, memory_limit=(p_wide + p_seq) / 2)
        assert sim.peak_bytes(g, out) <= (p_wide + p_seq) / 2 and out.meta["memory_cap_bytes"] > 0
    with pytest.raises(MemoryCapError, match="memory cap"):
        fit_memory(g, m, sim.model, wide, None, memory_limit=p_seq / 4)
    with pytest.warns(ScheduleFallbackWarning, match="memory cap"):  # the user is told why it runs eagerly
        step = opsched.train_step("critical-path-first", net, F.cross_entropy, opt, *_data(0), measure=0,
                                  memory_limit=p_seq / 4)
    assert not step.scheduled and step.fallback.reason is FallbackReason.MEMORY


def test_apply_mode_train_cli_writes_the_rows(tmp_path, monkeypatch, capsys):
    factory = tmp_path / "mine.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "def build(batch):\n"
        "    torch.manual_seed(0)\n"
        "    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "    return m, torch.randn(batch, 16), torch.randint(0, 4, (batch,)), F.cross_entropy\n")
    code, out, err = run_cli(["apply", "--mode", "train", "--model", f"{factory}:build", "--batch", "8",
                              "--policy", "critical-path-first", "--repeats", "3", "--warmup", "1", "--measure", "0",
                              "--no-progress", "--optimizer", "adam", "--json", str(tmp_path / "r.json")],
                             monkeypatch, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["mode"] == "train" and data["reference"] == "eager" and data["framework"] == "torch-train"
    assert [r["config"] for r in data["rows"]][:2] == ["eager", "eager-1-thread"] or \
        [r["config"] for r in data["rows"]][0] == "eager"
    assert all(r["outputs_equal_eager"] for r in data["rows"])
    assert "training step" in out


def test_train_specs_and_compare_mode_train(tmp_path, monkeypatch, capsys):
    from opsched.specs import load_graph

    g = load_graph("train:zoo:lstm@2x0.25:adam", cache_dir=tmp_path / "graphs")
    assert g.meta["mode"] == "train" and g.meta["step"]["optimizer"] == "Adam"
    again = load_graph("train:zoo:lstm@2x0.25:adam", cache_dir=tmp_path / "graphs")
    assert again.fingerprint() == g.fingerprint() and again.source is None  # cached JSON: simulation only
    code, _, err = run_cli(["compare", "--mode", "train", "--model", "zoo:lstm@2x0.25", "--machine", "knl-68",
                            "--policies", "sequential,critical-path-first", "--no-progress", "--gantt", "none",
                            "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 0, err
    rows = json.loads(next(tmp_path.glob("compare_*/results.json")).read_text())["results"]
    assert {r["graph"] for r in rows} >= {"train:zoo:lstm@2x0.25"}


def test_the_machines_load_is_sampled_and_plans_stay_valid_on_the_idle_machine():
    from opsched.machine import Machine
    from opsched.policies import get_policy
    from opsched.synthetic import generate

    idle = Machine.probe().cpu_only()
    if idle.cpu.cores < 2:
        pytest.skip("needs two cores: one to keep busy, one to measure")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()+20\nwhile time.time()<t: pass"])
    try:
        time.sleep(0.3)
        loaded = Machine.probe(load=True).cpu_only()
    finally:
        spin.kill()
        spin.wait()
    assert loaded.cpu.busy_cores >= 1 and loaded.loaded
    assert loaded.fingerprint() != idle.fingerprint() and loaded.hardware_fingerprint() == idle.hardware_fingerprint()
    g = generate("layered", 30, 1)
    plan = get_policy("critical-path-first").plan(g, loaded)
    plan.validate(g, idle)  # made under load, valid on the idle machine
    get_policy("critical-path-first").plan(g, idle).validate(g, loaded)


def test_the_measured_choice_times_the_plan_against_eager_and_keeps_the_faster():
    """With measuring on (the default), the kept plan is timed against eager's step here; if eager
    is faster the eager step runs, saying so - either way the step trains as eager does."""
    torch.manual_seed(3)
    ours = Net().train()
    ref = copy.deepcopy(ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, foreach=False)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ScheduleFallbackWarning)
        step = opsched.train_step(None, ours, F.cross_entropy, opt, *_data(0))
    if step.scheduled:
        assert step.meta_timing is not None and step.meta_timing["ratio"] < 1.0
        assert step.plan.meta.get("measured"), "the candidates were timed"
    else:
        assert step.fallback.reason is FallbackReason.FRAMEWORK_FASTER, step.fallback
        assert any("eager PyTorch ran this step" in str(w.message) for w in caught)
    for i in range(3):
        x, y = _data(i)
        assert torch.allclose(step(x, y), _eager(ref, opt_ref, x, y), rtol=1e-4, atol=1e-5)


def test_the_step_check_allows_eagers_own_thread_variation_and_no_more():
    """``same_step``: a parameter or momentum buffer off by more than the fixed tolerance fails,
    unless eager's own step at another thread count is at least half as far off (``spread``);
    an error beyond twice eager's variation fails even then."""
    from opsched.adapters.train import clone_training, eager_spread, eager_step, same_step
    from opsched.specs import TrainingNetwork, make_optimizer

    torch.manual_seed(0)
    m = Net()
    net = TrainingNetwork(m, F.cross_entropy, make_optimizer("sgd", m, 0.1))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    state = torch.get_rng_state()
    want = clone_training(net)
    loss = eager_step(want, x, y)
    spread = eager_spread(net, x, y, state)
    assert same_step(spread, want, loss, loss, spread) is None  # eager at another thread count passes

    def off(by: float, spread_by: float | None) -> str | None:
        got, other = clone_training(want), clone_training(want)
        with torch.no_grad():
            got.module.fc.weight.add_(by)
            if spread_by is not None:
                other.module.fc.weight.add_(spread_by)
        return same_step(got, want, loss, loss, other if spread_by is not None else None)

    assert off(1e-3, None) == "fc.weight after one step differs from eager's"
    assert off(1e-3, 0.6e-3) is None                      # within twice eager's own variation
    assert off(1e-3, 0.3e-3) == "fc.weight after one step differs from eager's"
