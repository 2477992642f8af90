"""Training-step capture (make_fx): a captured step run for real equals eager training.

Every check compares against eager PyTorch doing the same thing to a deep copy:
``optimizer.zero_grad(); loss_fn(module(x), y).backward(); optimizer.step()``.
Steps run sequentially (``run_node_by_node``) and on ``TorchCPUBackend`` under
several valid plans; parameters, buffers, optimizer state, loss curves and the
RNG must agree.  Also: phases, the inference fallback (a HuggingFace BERT), the
zoo in train mode, and every refusal's message.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsched.backends.torch_cpu import TorchCPUBackend
from opsched.errors import ModelImportError
from opsched.graph import OpGraph
from opsched.importers.torch_aten import capture_inference
from opsched.importers.torch_fx import from_torch
from opsched.importers.torch_step import StepRunner, StepSignatureError, capture_step
from opsched.machine import Machine
from opsched.phases import PHASES, check_phases, op_phases, phase_counts
from opsched.plan import uniform_plan
from opsched.policies import get_policy
from opsched.zoo import ZOO
from opsched.zoo.training import build_train, default_loss, example_targets

RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread for eager and the sequential replay alike (plans set their own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def machine() -> Machine:
    probe = Machine.probe()
    return Machine("test-2c", (dataclasses.replace(probe.cpu, cores=2),))


@pytest.fixture(scope="module")
def backend(machine):
    b = TorchCPUBackend(machine)
    yield b
    b.close()


class ConvNet(nn.Module):
    """conv -> BN -> ReLU, a second conv branch, concat, linear: two backward branches and BN buffers.

    The conv before BN has no bias, as in real networks: BN cancels it, so its
    gradient is rounding noise (~1e-8, different at 1 and 2 threads even in
    eager) that Adam would normalise into full-size steps of either sign."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.b = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(10 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.cat([self.a(x), torch.tanh(self.b(x))], 1), 1))


def _data(step: int, batch: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _eager_step(module, loss_fn, opt, x, y):
    opt.zero_grad()
    loss = loss_fn(module(*x) if isinstance(x, tuple) else module(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _assert_same_state(eager: nn.Module, ours: nn.Module, opt_e, opt_c, rtol: float = RTOL) -> None:
    """Parameters and buffers element by element (rtol, atol 1e-6); optimizer state
    (momentum, moments: gradient-like, most entries near zero) to ``10 * rtol`` of
    each tensor's largest entry - elementwise, or at ``rtol``, it would be stricter
    than eager is with itself: randwire's momentum buffers (largest entries ~1)
    after 3 eager steps at 1 and at 2 threads differ by 1.4e-4, while the captured
    step's differ from eager's by ~4e-6 (up to 1.4e-4 of a 2-entry tensor)."""
    sd_e, sd_c = eager.state_dict(), ours.state_dict()
    assert sd_e.keys() == sd_c.keys()
    for k in sd_e:
        assert sd_e[k].dtype == sd_c[k].dtype, k
        torch.testing.assert_close(sd_c[k], sd_e[k], rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    os_e, os_c = opt_e.state_dict(), opt_c.state_dict()
    assert os_e["param_groups"] == os_c["param_groups"]
    assert os_e["state"].keys() == os_c["state"].keys()
    for i, st in os_e["state"].items():
        assert st.keys() == os_c["state"][i].keys(), i
        for key, v in st.items():
            w = os_c["state"][i][key]
            if key == "step":
                assert torch.equal(v, w) and v.dtype == w.dtype
            else:
                torch.testing.assert_close(w, v, rtol=0, atol=max(10 * rtol * float(v.abs().max()), 1e-7),
                                           msg=lambda m, i=i, key=key: f"state {i} {key}: {m}")


def _executors(graph: OpGraph, machine: Machine, backend: TorchCPUBackend):
    """Sequential replay, then the backend under four valid plans."""
    plans = [uniform_plan(graph, machine, 1, policy="sequential-1"), uniform_plan(graph, machine, 2),
             get_policy("critical-path-first").plan(graph, machine), get_policy("random", seed=7).plan(graph, machine)]
    return [None] + [functools.partial(backend.execute, graph, p) for p in plans]


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05),
}


# ------------------------------------------------------ equal to eager
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_twenty_steps_equal_eager_under_plans(opt_name, machine, backend):
    torch.manual_seed(0)
    eager = ConvNet().train()
    ours = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt_name](eager.parameters()), OPTIMIZERS[opt_name](ours.parameters())
    x0, y0 = _data(0)
    graph = capture_step(ours, F.cross_entropy, opt_c, x0, y0, name="convnet")
    assert not opt_c.state  # capturing changes nothing
    step = StepRunner(graph, ours, opt_c)
    runs = _executors(graph, machine, backend)
    curve_e, curve_c = [], []
    for i in range(20):
        x, y = _data(i)
        curve_e.append(_eager_step(eager, F.cross_entropy, opt_e, x, y))
        curve_c.append(step(x, y, execute=runs[i % len(runs)]))
    torch.testing.assert_close(torch.stack(curve_c), torch.stack(curve_e), rtol=RTOL, atol=0)
    _assert_same_state(eager, ours, opt_e, opt_c)
    assert int(eager.a[1].num_batches_tracked) == int(ours.a[1].num_batches_tracked) == 20


OPTIONS = {
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-dampening-wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-2),
    "sgd-nesterov-maximize": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True, maximize=True),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2,
                                                    amsgrad=True),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("opt_name", list(OPTIONS))
def test_optimizer_options_equal_eager(opt_name):
    torch.manual_seed(1)
    eager = ConvNet().train()
    ours = copy.deepcopy(eager)
    opt_e, opt_c = OPTIONS[opt_name](eager.parameters()), OPTIONS[opt_name](ours.parameters())
    step = StepRunner(capture_step(ours, F.cross_entropy, opt_c, *_data(0)), ours, opt_c)
    for i in range(6):
        x, y = _data(i)
        torch.testing.assert_close(step(x, y), _eager_step(eager, F.cross_entropy, opt_e, x, y), rtol=RTOL, atol=0)
    _assert_same_state(eager, ours, opt_e, opt_c)


def test_exact_mode_multiplies_matrices_as_eager_does():
    """Autograd picks a matmul's backward formula by its operands' strides (a Linear's
    weight gradient is ``grad.t() @ x`` because the weight enters transposed).  Traced
    with views replaced by copies, the transposed weight looked contiguous and the
    capture computed ``(x.t() @ grad).t()`` instead: the same sums in another GEMM,
    bitwise equal to eager on one CPU (an Intel Xeon) and not on another (an AMD EPYC).
    So exact mode traces with views kept, and its products have eager's shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    class Products(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                self.shapes.append((str(func), *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(10)
    eager = ConvNet().train()
    opt = OPTIMIZERS["sgd-momentum"](eager.parameters())
    ours = copy.deepcopy(eager)
    graph = capture_step(ours, F.cross_entropy, OPTIMIZERS["sgd-momentum"](ours.parameters()), *_data(0), exact=True)
    with Products() as rec:
        _eager_step(eager, F.cross_entropy, opt, *_data(0))
    captured = [(str(n.target), *(tuple(a.meta["val"].shape) for a in n.args if isinstance(a, torch.fx.Node)))
                for n in graph.source.gm.graph.nodes if n.op == "call_function" and n.target in products]
    assert sorted(captured) == sorted(rec.shapes)
    assert ("aten.mm.default", (5, 4), (4, 640)) in captured  # the weight gradient: grad.t() @ x


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw", "sgd-dampening-wd", "adam-amsgrad-wd"])
@pytest.mark.parametrize("write", ["swap", "copy"])
def test_exact_mode_is_bitwise_equal_to_eager(opt_name, write):
    """exact=True writes torch's update op for op: the sequential replay equals eager bit for bit."""
    make = {**OPTIMIZERS, **OPTIONS}[opt_name]
    torch.manual_seed(10)
    eager = ConvNet().train()
    ours = copy.deepcopy(eager)
    opt_e, opt_c = make(eager.parameters()), make(ours.parameters())
    graph = capture_step(ours, F.cross_entropy, opt_c, *_data(0), exact=True)
    assert graph.meta["step"]["exact"] is True
    step = StepRunner(graph, ours, opt_c, write=write)
    weight, ptr = ours.fc.weight, ours.fc.weight.data_ptr()
    for i in range(10):
        x, y = _data(i)
        assert torch.equal(step(x, y), _eager_step(eager, F.cross_entropy, opt_e, x, y)), i
    _assert_same_state(eager, ours, opt_e, opt_c, rtol=0)
    for (k, v), w in zip(eager.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(v, w), k
    for i, st in opt_e.state_dict()["state"].items():
        for key, v in st.items():
            assert torch.equal(v, opt_c.state_dict()["state"][i][key]), (i, key)
    assert ours.fc.weight is weight  # the same Parameter object either way
    # the update writes the new weight into the old one in place (opsched.importers.torch_step.update_in_place),
    # as optimizer.step() does: the storage is kept in both write modes
    assert ours.fc.weight.data_ptr() == ptr


def test_lr_changes_and_param_groups_with_different_options():
    """Two param groups with different momentum / weight decay; a scheduler moves lr every step."""
    torch.manual_seed(2)
    eager = ConvNet().train()
    ours = copy.deepcopy(eager)

    def make(m):
        opt = torch.optim.SGD([{"params": m.a.parameters(), "momentum": 0.5},
                               {"params": list(m.b.parameters()) + list(m.fc.parameters()), "weight_decay": 0.1}],
                              lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    (opt_e, sched_e), (opt_c, sched_c) = make(eager), make(ours)
    step = StepRunner(capture_step(ours, F.cross_entropy, opt_c, *_data(0)), ours, opt_c)
    for i in range(8):
        x, y = _data(i)
        torch.testing.assert_close(step(x, y), _eager_step(eager, F.cross_entropy, opt_e, x, y), rtol=RTOL, atol=0)
        sched_e.step()
        sched_c.step()
        if i == 4:  # a manual change, as a user may make
            opt_e.param_groups[1]["lr"] = opt_c.param_groups[1]["lr"] = 0.5
    _assert_same_state(eager, ours, opt_e, opt_c)


class PartlyUsed(nn.Module):
    """An unused layer (no grad in eager: torch skips it) and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 3)
        self.unused = nn.Linear(6, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(torch.relu(self.frozen(x)))


def test_unused_and_frozen_parameters_are_left_alone():
    torch.manual_seed(3)
    eager = PartlyUsed()
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.5)
    opt_c = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.5)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    graph = capture_step(ours, F.cross_entropy, opt_c, x, y)
    lay = graph.source.layout
    assert [lab for r, lab in lay.outputs if r == "param"] == ["used.weight", "used.bias"]
    before = ours.unused.weight.clone()
    step = StepRunner(graph, ours, opt_c)
    for _ in range(3):
        torch.testing.assert_close(step(x, y), _eager_step(eager, F.cross_entropy, opt_e, x, y), rtol=RTOL, atol=0)
    assert torch.equal(ours.unused.weight, before)
    _assert_same_state(eager, ours, opt_e, opt_c)


def test_dropout_follows_the_rng_rule(machine, backend):
    """Random ops run in eager's order: after the same seed, eager's numbers and generator state."""
    torch.manual_seed(4)
    eager = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.5),
                          nn.Linear(32, 4)).train()
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    graph = capture_step(ours, F.cross_entropy, opt_c, x, y)
    assert len(graph.meta["random_ops"]) == 2
    a, b = graph.meta["random_ops"]
    assert b in graph.successors(a)  # chained: every plan keeps their order
    step = StepRunner(graph, ours, opt_c)
    runs = _executors(graph, machine, backend)
    for i in range(6):
        torch.manual_seed(100 + i)
        le = _eager_step(eager, F.cross_entropy, opt_e, x, y)
        after_e = torch.rand(3)
        torch.manual_seed(100 + i)
        lc = step(x, y, execute=runs[i % len(runs)])
        assert torch.equal(torch.rand(3), after_e)
        torch.testing.assert_close(lc, le, rtol=RTOL, atol=0)
    _assert_same_state(eager, ours, opt_e, opt_c)


def test_capture_changes_nothing():
    torch.manual_seed(5)
    m = ConvNet().train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    sd = copy.deepcopy(m.state_dict())
    rng = torch.get_rng_state()
    capture_step(m, F.cross_entropy, opt, *_data(0))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not opt.state
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k


# ------------------------------------------------------ graph structure
def test_every_op_has_a_phase_in_order():
    torch.manual_seed(6)
    m = ConvNet().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    g = capture_step(m, F.cross_entropy, opt, *_data(0))
    check_phases(g)  # every op has a phase; no edge goes back to an earlier phase
    phases = op_phases(g)
    assert set(phases) == {op.id for op in g.ops}
    counts = phase_counts(g)
    assert all(counts[p] > 0 for p in PHASES)
    # One update op per trainable parameter; nothing runs after the updates.
    n_params = len(list(m.parameters()))
    assert counts["update"] == n_params
    for op in g.ops:
        if phases[op.id] == "update":
            assert not g.successors(op.id)
    # The backward starts from the loss: the ops that read the loss op are backward ops,
    # and every forward op precedes a backward op.
    backward = {o for o, p in phases.items() if p == "backward"}
    seen, stack = set(), [o for o in phases if phases[o] == "forward" and not g.predecessors(o)]
    while stack:
        for s in g.successors(stack.pop()):
            if s not in seen:
                seen.add(s)
                stack.append(s)
    assert backward <= seen
    kinds = {op.kind for op in g.ops}
    assert {"conv", "matmul", "norm", "elementwise"} <= kinds
    assert g.total_flops > 0
    # Layout: what every output is.
    lay = g.source.layout
    assert lay.outputs[0] == ("loss", "loss")
    assert {lab for r, lab in lay.outputs if r == "buffer"} == {n for n, _ in m.named_buffers()}
    assert len(lay.output_indices("state")) == n_params
    assert g.meta["step"]["outputs"]["loss"] == [[0, "loss"]]
    # Phases survive JSON.
    assert op_phases(OpGraph.from_dict(g.to_dict())) == phases


def test_conv_backward_is_split_into_input_and_weight_gradients():
    """A conv whose input needs a gradient gets two backward ops that can co-run:
    the input gradient (critical path) and the weight gradient (feeds only its update)."""
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(64, 5))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = capture_step(m, F.cross_entropy, opt, torch.randn(2, 3, 8, 8), torch.randint(0, 5, (2,)))
    masks = [n.args[10] for n in g.source.gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert sorted(map(list, masks)) == [[False, True, True], [False, True, True], [True, False, False]]
    nodes = {n.name: n for n in g.source.gm.graph.nodes}
    conv_bwd = [op for op in g.ops if "convolution_backward" in op.name]
    assert len(conv_bwd) == 3 and all(op.kind == "conv" and op.flops > 0 for op in conv_bwd)
    grad_in = next(op.id for op in conv_bwd if nodes[op.id].args[10][0])
    grad_w = next(op.id for op in conv_bwd if nodes[op.id].args[1] is nodes[grad_in].args[1] and op.id != grad_in)
    assert grad_w not in g.successors(grad_in) and grad_in not in g.successors(grad_w)


# ------------------------------------------------------ refusals
class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return -self.l(x)


class ItemRead(DataDependent):
    def forward(self, x):
        return self.l(x) * x.max().item()


class MutatesWeight(DataDependent):
    def forward(self, x):
        with torch.no_grad():
            self.l.weight.mul_(0.5)
        return self.l(x)


def _hooked() -> nn.Module:
    m = nn.Linear(8, 4)
    m.register_forward_hook(lambda *a: None)
    return m


def _with_step_hook(opt):
    opt.register_step_post_hook(lambda *a: None)
    return opt


REFUSALS = {
    "optimizer": (lambda: nn.Linear(8, 4), F.cross_entropy, lambda m: torch.optim.RMSprop(m.parameters()),
                  "RMSprop is not supported"),
    "differentiable": (lambda: nn.Linear(8, 4), F.cross_entropy,
                       lambda m: torch.optim.SGD(m.parameters(), lr=0.1, differentiable=True), "differentiable=True"),
    "foreign-param": (lambda: nn.Linear(8, 4), F.cross_entropy,
                      lambda m: torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), "not a parameter of the module"),
    "control-flow": (DataDependent, F.cross_entropy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     r"data-dependent .*test_train_step_capture.py:\d+ in forward: if x.sum\(\) > 0"),
    "item": (ItemRead, F.cross_entropy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
             r"_local_scalar_dense.*reads a tensor value on the host.*test_train_step_capture.py:\d+ in forward: .*"
             r"x.max\(\).item\(\)"),
    "in-place-param": (MutatesWeight, F.cross_entropy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       "writes into parameter 'l.weight' in place"),
    "hook": (_hooked, F.cross_entropy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "has a forward hook"),
    "optimizer-hook": (lambda: nn.Linear(8, 4), F.cross_entropy,
                       lambda m: _with_step_hook(torch.optim.SGD(m.parameters(), lr=0.1)), "step hook"),
    "loss-shape": (lambda: nn.Linear(8, 4), lambda o, t: F.cross_entropy(o, t, reduction="none"),
                   lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "0-d floating tensor.*shape \\(4,\\)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_cases_are_refused_clearly(case):
    make, loss_fn, make_opt, message = REFUSALS[case]
    m = make()
    with pytest.raises(ModelImportError, match=message):
        capture_step(m, loss_fn, make_opt(m), torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_sparse_gradients_are_refused():
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ModelImportError, match="sparse=True"):
        capture_step(m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1),
                     torch.randint(0, 10, (4, 2)), torch.randint(0, 3, (4,)))


def test_calls_that_do_not_match_the_capture_are_refused():
    m = ConvNet().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    step = StepRunner(capture_step(m, F.cross_entropy, opt, *_data(0)), m, opt)
    step(*_data(0))
    with pytest.raises(StepSignatureError, match=r"x\[0\] is \(2, 3, 8, 8\).*captured for \(4, 3, 8, 8\)"):
        step(*_data(1, batch=2))
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(StepSignatureError, match="momentum changed from 0.9 to 0.5"):
        step(*_data(1))
    opt.param_groups[0]["momentum"] = 0.9
    m.eval()
    with pytest.raises(StepSignatureError, match="train/eval modes changed"):
        step(*_data(1))
    m.train()
    handle = m.fc.register_forward_hook(lambda *a: None)
    with pytest.raises(ModelImportError, match="forward hook"):
        step(*_data(1))
    handle.remove()
    step(*_data(1))
    other = PartlyUsed()
    with pytest.raises(StepSignatureError, match="module with other parameters"):
        StepRunner(step.graph, other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    twin = copy.deepcopy(m)
    with pytest.raises(StepSignatureError, match="Adam.*SGD|optimizer changed"):
        StepRunner(step.graph, twin, torch.optim.Adam(twin.parameters()))


def test_a_graph_serves_any_module_of_the_same_structure():
    """Bind the captured graph to a deep copy (what a check against eager from the same state needs)."""
    torch.manual_seed(9)
    m = ConvNet().train()
    twin, eager = copy.deepcopy(m), copy.deepcopy(m)
    mk = OPTIMIZERS["adam"]
    opt_m, opt_t, opt_e = mk(m.parameters()), mk(twin.parameters()), mk(eager.parameters())
    graph = capture_step(m, F.cross_entropy, opt_m, *_data(0))
    step = StepRunner(graph, twin, opt_t)
    for i in range(3):
        x, y = _data(i)
        torch.testing.assert_close(step(x, y), _eager_step(eager, F.cross_entropy, opt_e, x, y), rtol=RTOL, atol=0)
    _assert_same_state(eager, twin, opt_e, opt_t)
    assert not opt_m.state  # the capturing module and optimizer are untouched


# ------------------------------------------------------ zoo in train mode
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_default_losses_accept_example_targets(name):
    ex = build_train(name, batch=2, width=0.25)
    assert ex.module.training and ex.loss_fn is default_loss(name)
    with torch.no_grad():
        loss = ex.loss_fn(ex.module(*ex.inputs), ex.targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert torch.equal(example_targets(name, ex.module, ex.inputs), ex.targets)  # seeded


def test_zoo_batch_norm_models_need_batch_two():
    for name in ("inception", "resnet50", "nasnet", "randwire"):
        with pytest.raises(ModelImportError, match="needs batch >= 2.*BatchNorm"):
            build_train(name, batch=1, width=0.25)
    build_train("lstm", batch=1, width=0.25)  # no BatchNorm: batch 1 is fine


@pytest.mark.parametrize("name", ["randwire", "transformer"])
def test_zoo_train_steps_equal_eager(name, machine, backend):
    ex = build_train(name, batch=2, width=0.25)
    eager, ours = copy.deepcopy(ex.module), ex.module
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    graph = capture_step(ours, ex.loss_fn, opt_c, ex.inputs, ex.targets, name=name)
    check_phases(graph)
    step = StepRunner(graph, ours, opt_c)
    plan = get_policy("critical-path-first").plan(graph, machine)
    for i in range(3):
        lc = step(ex.inputs, ex.targets, execute=(lambda inp: backend.execute(graph, plan, inp)) if i else None)
        torch.testing.assert_close(lc, _eager_step(eager, ex.loss_fn, opt_e, ex.inputs, ex.targets), rtol=RTOL, atol=0)
    _assert_same_state(eager, ours, opt_e, opt_c)


# ------------------------------------------------------ inference capture
class ItemAssign(nn.Module):
    """Writes into a slice of a new tensor: torch.fx cannot trace it ('Proxy' item assignment)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        out = torch.zeros(x.shape[0], 8)
        out[:, :6] = self.bn(self.l(x))
        out[:, 6:] = x[:, :2].relu()
        return {"out": out, "n": x.shape[0]}


def test_inference_capture_handles_what_torch_fx_cannot(machine, backend):
    torch.manual_seed(7)
    m = ItemAssign().eval()
    x = torch.randn(4, 6)
    with pytest.raises(ModelImportError, match="torch.fx"):
        from_torch(m, (x,))
    g = capture_inference(m, (x,))
    with torch.no_grad():
        ref = m(x)
    for out in (g.source.run_node_by_node(x), backend.execute(g, get_policy("random", seed=3).plan(g, machine), (x,))):
        assert out["n"] == 4
        torch.testing.assert_close(out["out"], ref["out"], rtol=0, atol=0)


def test_inference_capture_equals_eager_and_torch_fx_flops():
    m, inputs = ZOO["resnet50"].build(batch=2, width=0.25)
    g = capture_inference(m, inputs, name="resnet50")
    with torch.no_grad():
        torch.testing.assert_close(g.source.run_node_by_node(*inputs), m(*inputs), rtol=0, atol=0)
    assert g.total_flops == from_torch(m, inputs).total_flops
    assert "phases" not in g.meta


def test_inference_capture_refuses_train_mode_batch_norm():
    m = ItemAssign().train()
    with pytest.raises(ModelImportError, match=r"writes into buffer/parameter 'bn\.running_mean'.*module\.eval\(\)"):
        capture_inference(m, (torch.randn(4, 6),))


def test_hugging_face_bert_imports_and_runs(machine, backend):
    transformers = pytest.importorskip("transformers", reason="pip install transformers (in the test extra)")
    torch.manual_seed(8)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertModel(cfg).eval()  # random weights, no download
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with pytest.raises(ModelImportError, match="Proxy"):
        from_torch(model, (ids,))  # what a new user meets today
    g = capture_inference(model, (ids,), {"attention_mask": mask}, name="bert")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask)
    plan = get_policy("critical-path-first").plan(g, machine)
    for out in (g.source.run_node_by_node(ids, mask), backend.execute(g, plan, (ids, mask))):
        assert type(out) is type(ref)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-6)
    # Another mask on the same graph: the mask is an input, not a constant of the capture.
    mask2 = torch.ones_like(mask)
    with torch.no_grad():
        ref2 = model(ids, attention_mask=mask2)
    torch.testing.assert_close(g.source.run_node_by_node(ids, mask2).last_hidden_state, ref2.last_hidden_state,
                               rtol=1e-5, atol=1e-6)
