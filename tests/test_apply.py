"""``opsched.apply`` and ``opsched apply`` (issue 7): the Plan runs on the real
runtime with eager's outputs, plans are cached, and anything the policy cannot
handle falls back to eager execution with a warning -- never to wrong results."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import opsched.commands.apply  # noqa: F401  (registers the command)
from opsched.cli import app
from opsched.machine import Device, Machine
from opsched.policies.base import Policy
from opsched.policies.exported import load, pretrained_path, write_policy
from opsched.policies.numpy_encoder import array_shapes
from opsched.scheduled import ScheduleFallbackWarning, apply

torch.set_num_threads(1)


class Branchy(nn.Module):
    """Two parallel conv branches joined by a concat: something to co-run."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 1)
        self.c = nn.Conv2d(16, 4, 3, padding=1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), torch.sigmoid(self.b(x))], 1)
        return self.drop(torch.relu(self.c(y))).mean((2, 3))


FACTORY = '''
import torch
from torch import nn

def build(batch):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return m, (torch.randn(batch, 16),)
'''


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {k: rng.normal(0.0, 0.3, s).astype(np.float32) for k, s in array_shapes(16, 2).items()}
    return write_policy(tmp_path_factory.mktemp("pol") / "policy", arrays, hidden=16, rounds=2, max_nodes=32)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Branchy().eval(), torch.randn(2, 3, 8, 8)


def test_scheduled_outputs_equal_eager(policy_dir, net):
    module, x = net
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFallbackWarning)
        sm = apply(policy_dir, module, x, backend="torch-cpu")
        assert sm.scheduled and sm.plan.policy == "learned" and len(sm.plan) == len(sm.graph.ops)
        out = sm(x)
    assert torch.allclose(out, module(x), rtol=1e-4, atol=1e-5)
    assert isinstance(sm, nn.Module) and "learned" in repr(sm)


def test_plans_are_cached(policy_dir, net):
    inner = load(policy_dir)
    calls = []

    class Counting(Policy):
        name = "counting"

        def plan(self, graph, machine, model=None):
            calls.append(graph.fingerprint())
            return inner.plan(graph, machine, model)

    module, x = net
    a = apply(Counting(), module, x)
    b = apply(Counting(), module, x)
    assert len(calls) == 1 and a.plan is b.plan


def test_other_input_shape_falls_back_to_eager(policy_dir, net):
    module, x = net
    sm = apply(policy_dir, module, x)
    x2 = torch.randn(5, 3, 8, 8)
    with pytest.warns(ScheduleFallbackWarning, match=r"differ from the planned \(float32\[2, 3, 8, 8\]@cpu\)"):
        out = sm(x2)
    assert torch.equal(out, module(x2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFallbackWarning)
        assert torch.allclose(sm(x), module(x), rtol=1e-4, atol=1e-5)  # the planned shape still runs the Plan


def test_policy_that_cannot_plan_falls_back(policy_dir, net, tmp_path):
    with np.load(policy_dir / "weights.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    tiny = write_policy(tmp_path / "tiny", arrays, hidden=16, rounds=2, max_nodes=32, max_graph_ops=3)
    module, x = net
    with pytest.warns(ScheduleFallbackWarning, match="the policy cannot plan this graph: .* plans at most 3"):
        sm = apply(tiny, module, x)
    assert not sm.scheduled and torch.equal(sm(x), module(x))


def test_policy_in_a_wrong_format_falls_back(policy_dir, net, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "weights.npz").write_bytes((policy_dir / "weights.npz").read_bytes())
    (bad / "policy.json").write_text('{"format": "opsched.policy", "format_version": 7}')
    module, x = net
    with pytest.warns(ScheduleFallbackWarning, match="unknown policy format version 7"):
        sm = apply(bad, module, x)
    assert not sm.scheduled and torch.equal(sm(x), module(x))


def test_machine_the_policy_was_not_made_for_falls_back(policy_dir, net):
    huge = Machine("huge", (Device("cpu", "cpu", 256, 50.0, 200.0, 512.0),))  # 9 thread levels > MAX_LEVELS
    module, x = net
    with pytest.warns(ScheduleFallbackWarning, match="cannot plan for this machine"):
        sm = apply(policy_dir, module, x, machine=huge)
    assert torch.equal(sm(x), module(x))


def test_training_mode_and_grad_inputs_run_eagerly(policy_dir, net):
    module, x = net
    sm = apply(policy_dir, module, x)
    xg = x.clone().requires_grad_(True)
    with pytest.warns(ScheduleFallbackWarning, match="requires grad"):
        out = sm(xg)
    assert out.requires_grad
    sm.train()
    with pytest.warns(ScheduleFallbackWarning, match="training mode"):
        sm(x)
    with pytest.warns(ScheduleFallbackWarning, match="training mode; call module.eval"):
        assert not apply(policy_dir, Branchy().train(), x).scheduled


def test_heuristic_by_name_and_pretrained_default(net):
    module, x = net
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFallbackWarning)
        cpf = apply("critical-path-first", module, x, backend="torch-cpu")
        assert cpf.plan.policy == "critical-path-first"
        assert (pretrained_path() / "policy.json").is_file()
        pre = apply(None, module, x, backend="torch-cpu")
        assert pre.scheduled and pre.plan.policy == "learned"
        assert torch.allclose(pre(x), module(x), rtol=1e-4, atol=1e-5)


def test_cli_apply_save_and_replay_plan(policy_dir, tmp_path):
    factory = tmp_path / "mymodel.py"
    factory.write_text(FACTORY)
    plan_file = tmp_path / "plan.json"
    runner = CliRunner()
    spec = f"{factory}:build"
    res = runner.invoke(app, ["apply", "--backend", "torch-cpu", "--policy", str(policy_dir), "--model", spec,
                              "--batch", "3",
                              "--repeats", "2", "--warmup", "0", "--save-plan", str(plan_file),
                              "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "critical-path-first" in res.output and "speed-up" in res.output
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["eager", "critical-path-first", "policy (learned)"]
    assert all(r["outputs_equal_eager"] and r["median_s"] > 0 for r in result["rows"])
    assert plan_file.is_file()
    res2 = runner.invoke(app, ["apply", "--backend", "torch-cpu", "--plan", str(plan_file), "--model", spec,
                               "--batch", "3",
                               "--repeats", "1", "--warmup", "0"])
    assert res2.exit_code == 0, res2.output
    assert "saved plan" in res2.output
    res3 = runner.invoke(app, ["apply", "--backend", "torch-cpu", "--plan", str(plan_file), "--model", spec,
                               "--batch", "4",
                               "--repeats", "1", "--warmup", "0"])
    assert res3.exit_code != 0 and "made for a different graph" in str(res3.exception)
