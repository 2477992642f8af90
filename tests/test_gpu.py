"""GPU execution (issue 8): the CUDA runtime, the GPU profiler, bench/gpu_check.sh.

Two layers:

* CPU tests (always run): the stream compilation - issue order, stream
  assignment, copy insertion, event waits - checked against an independent
  happens-before model of CUDA streams; the whole runtime path in emulation
  (every device mapped to the host, streams and events stand-ins) against
  eager outputs; clear errors without CUDA; the simulator's pricing of
  CPU<->GPU transfers; the measured-GPU performance model on a hand-made
  profile; gpu_check.sh refusing to pretend on a machine without a GPU.
* ``gpu``-marked tests (skipped without CUDA): outputs equal eager execution
  on the GPU for every zoo model, multi-stream and single-stream plans,
  CPU+GPU mixed plans, cross-device copies, multi-GPU placement, trace
  validity, CUDA-graph capture, the GPU profiler.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _nets import Branchy
from torch import nn

from opsched.backends.gpu_profiler import profile_gpu
from opsched.backends.sim import SimBackend
from opsched.backends.torch_cuda import (
    TorchCUDABackend,
    compile_streams,
    happens_before_violations,
    issue_order,
    visible_gpu_problems,
)
from opsched.engine.models.gpu import GPU_TIMER, GPUProfileModel, gpu_cache_path
from opsched.engine.profiles import OpProfile, Profile, ProfileError
from opsched.errors import ExecutionError, PlanError
from opsched.graph import Edge, Op, OpGraph
from opsched.importers.torch_fx import from_torch
from opsched.machine import Device, Link, Machine, get_machine
from opsched.plan import Assignment, Plan, uniform_plan
from opsched.synthetic import generate
from opsched.trace import Trace
from opsched.zoo import ZOO

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ helpers
def _flat(x):
    return list(torch.utils._pytree.tree_leaves(x))


def _close(a, b, rtol=1e-4, atol=1e-5) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        torch.allclose(x.detach().cpu().float(), y.detach().cpu().float(), rtol=rtol, atol=atol)
        for x, y in zip(fa, fb, strict=True))


def _one_gpu_machine(streams: int = 4, cpu_cores: int = 2) -> Machine:
    return Machine("test-1gpu", (
        Device("cpu", "cpu", cpu_cores, 50.0, 20.0, 16.0),
        Device("gpu:0", "gpu", streams, 20000.0, 1000.0, 16.0, name="test gpu"),
    ), (Link("cpu", "gpu:0", 12.0, 10.0),))


def _chain(n: int) -> OpGraph:
    ops = tuple(Op(f"o{i}", f"o{i}", "elementwise", 1e4, 4e3, 4e3) for i in range(n))
    return OpGraph(ops, tuple(Edge(f"o{i}", f"o{i + 1}", 4e3) for i in range(n - 1)), name=f"chain{n}")


def _random_plan(graph: OpGraph, machine: Machine, devices, seed: int, max_threads: int = 2) -> Plan:
    rng = random.Random(seed)
    topo = [graph.ops[i].id for i in graph.topo_index]
    pos = {o: k for k, o in enumerate(topo)}
    out = {}
    for op in graph.ops:
        d = rng.choice(devices)
        after = ()
        if rng.random() < 0.15 and pos[op.id]:
            after = (rng.choice(topo[: pos[op.id]]),)
        out[op.id] = Assignment(d, 1 if d != "cpu" else rng.randint(1, max_threads), rng.random(), after)
    return Plan.build(graph, machine, out, policy=f"random-{seed}")


def check_trace(trace: Trace, graph: OpGraph, plan: Plan, machine: Machine, tol: float = 0.0) -> None:
    """One event per op matching the plan; dependencies respected (within the
    host/GPU clock alignment ``tol``); no stream or core runs two ops at once."""
    ev = trace.by_op()
    assert len(trace.events) == len(graph.ops) and set(ev) == {op.id for op in graph.ops}
    for op in graph.ops:
        e, a = ev[op.id], plan[op.id]
        assert (e.device, e.threads) == (a.device, a.threads), f"op {op.id}: event does not match the plan"
        assert e.end >= e.start >= -tol
        for p in set(graph.predecessors(op.id)) | set(a.after):
            # Ops on one device share a clock; across host and GPU allow the alignment bound.
            slack = 0.0 if ev[p].device == e.device else tol
            assert e.start >= ev[p].end - slack - 1e-9, f"op {op.id} started before its dependency {p} ended"
    for e in trace.events:
        assert e.cores is not None and len(set(e.cores)) == e.threads
        assert all(0 <= c < machine.device(e.device).cores for c in e.cores)
    by_core: dict[tuple[str, int], list] = {}
    for e in trace.events:
        for c in e.cores:
            by_core.setdefault((e.device, c), []).append(e)
    for (dev, core), evs in by_core.items():
        evs.sort(key=lambda x: x.start)
        for x, y in zip(evs, evs[1:]):
            assert y.start >= x.end - 1e-9, f"ops {x.op} and {y.op} overlap on {dev} lane {core}"
    assert trace.makespan > 0


class InPlace(nn.Module):
    """Values mutated in place after other ops read them: copies must not go stale."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x)
        early = self.l2(h)          # reads h before the mutation
        h.mul_(2.0)
        h2 = h + early              # reads the mutated h
        late = self.l3(h2)
        return late + early, h2.sum(), h  # h: an output changed in place by another op


def _branchy():
    torch.manual_seed(0)
    m = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    return m, (x,), from_torch(m, (x,), name="branchy")


@pytest.fixture(scope="module")
def branchy():
    return _branchy()


@pytest.fixture(scope="module")
def two_gpu_machine() -> Machine:
    return get_machine("2x2080ti")


@pytest.fixture(scope="module")
def emulated(two_gpu_machine):
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    yield be
    be.close()


# ===================================================== compilation (CPU)
@pytest.mark.parametrize("policy", ["affinity", "round-robin"])
def test_single_gpu_schedule_is_safe_and_uses_the_streams(policy):
    g = generate("layered", 60, seed=3)
    m = _one_gpu_machine(streams=4)
    plan = uniform_plan(g, m, 1, device="gpu:0")
    s = compile_streams(g, plan, m, stream_policy=policy)
    assert sorted(s.order) == list(range(len(g.ops)))
    pos = {j: k for k, j in enumerate(s.order)}
    assert all(pos[p] < pos[j] for j in range(len(g.ops)) for p in g.pred_index[j]), "issue order is topological"
    assert all(0 <= st.stream < 4 for st in s.steps)
    assert not s.copies and s.devices == ("gpu:0",)
    assert happens_before_violations(g, plan, s) == []
    if policy == "round-robin":
        assert [st.stream for st in s.steps] == [k % 4 for k in range(len(g.ops))]
    else:
        assert len({st.stream for st in s.steps}) > 1, "independent ops spread over streams"


def test_affinity_keeps_chains_on_one_stream_without_events():
    g = _chain(12)
    m = _one_gpu_machine(streams=4)
    plan = uniform_plan(g, m, 1, device="gpu:0")
    aff = compile_streams(g, plan, m, stream_policy="affinity")
    rr = compile_streams(g, plan, m, stream_policy="round-robin")
    assert {st.stream for st in aff.steps} == {0} and aff.n_waits == 0 and not aff.needs_event
    assert rr.n_waits == len(g.ops) - 1, "round-robin puts each link of the chain on another stream"
    for s in (aff, rr):
        assert happens_before_violations(g, plan, s) == []


def test_issue_order_follows_priorities_and_defers_blocking_cpu_ops():
    # src -> {x, y, z} independent; priorities z > x > y.
    ops = tuple(Op(k, k, "matmul", 1e6, 1e4, 1e4) for k in ("src", "x", "y", "z"))
    g = OpGraph(ops, (Edge("src", "x", 1e3), Edge("src", "y", 1e3), Edge("src", "z", 1e3)), name="fan")
    m = _one_gpu_machine()
    pr = {"src": 9.0, "x": 2.0, "y": 1.0, "z": 3.0}
    plan = Plan.build(g, m, {k: Assignment("gpu:0", 1, v) for k, v in pr.items()})
    assert [g.ops[i].id for i in issue_order(g, plan)] == ["src", "z", "x", "y"]
    # z on the CPU waits for src's GPU result: the GPU ops x and y are queued first.
    mixed = Plan.build(g, m, {k: Assignment("cpu" if k == "z" else "gpu:0", 1, v) for k, v in pr.items()})
    assert [g.ops[i].id for i in issue_order(g, mixed)] == ["src", "x", "y", "z"]
    # A CPU op with no GPU dependency keeps its priority.
    cpu_src = Plan.build(g, m, {k: Assignment("cpu" if k in ("src", "z") else "gpu:0", 1, v) for k, v in pr.items()})
    assert [g.ops[i].id for i in issue_order(g, cpu_src)] == ["src", "z", "x", "y"]


@pytest.mark.parametrize("seed", range(12))
def test_mixed_plans_get_one_copy_per_value_and_destination(seed, two_gpu_machine):
    g = generate("layered" if seed % 2 else "erdos_renyi", 50, seed=seed)
    m = two_gpu_machine
    plan = _random_plan(g, m, ["cpu", "gpu:0", "gpu:1"], seed)
    policy = "affinity" if seed % 3 else "round-robin"
    s = compile_streams(g, plan, m, stream_policy=policy)
    assert happens_before_violations(g, plan, s) == []
    dev = {op.id: plan[op.id].device for op in g.ops}
    want = {(g.index[e.src], dev[e.dst]) for e in g.edges if e.bytes > 0 and dev[e.src] != dev[e.dst]}
    got = [(c.slot, c.dst) for c in s.copies]
    assert sorted(got) == sorted(want), "exactly one copy per (value, destination device)"
    for c in s.copies:
        assert c.src == dev[g.ops[c.slot].id] != c.dst and c.src_waits == (c.slot,)
    for st in s.steps:
        assert not st.copies_before, "values not mutated in place are copied eagerly, after their producer"
        assert (st.stream < 0) == (st.device == "cpu")
        assert st.stream < m.device(st.device).cores if st.stream >= 0 else True
        for c in st.copies_after:
            assert s.copies[c].slot == st.op


def test_checker_catches_missing_waits(two_gpu_machine):
    g = generate("layered", 40, seed=1)
    plan = _random_plan(g, two_gpu_machine, ["cpu", "gpu:0", "gpu:1"], 1)
    s = compile_streams(g, plan, two_gpu_machine)
    k = next(k for k, st in enumerate(s.steps) if st.waits)
    no_wait = dataclasses.replace(s, steps=s.steps[:k] + (dataclasses.replace(s.steps[k], waits=()),) + s.steps[k + 1:])
    assert happens_before_violations(g, plan, no_wait)
    c = next(c for c, w in enumerate(s.copy_waits) if w)
    cw = list(s.copy_waits)
    cw[c] = ()
    assert happens_before_violations(g, plan, dataclasses.replace(s, copy_waits=tuple(cw)))
    no_copy = dataclasses.replace(s, steps=tuple(dataclasses.replace(st, reads_copies=()) for st in s.steps))
    assert any("no copy" in p for p in happens_before_violations(g, plan, no_copy))


def test_mutated_values_are_copied_per_reader(two_gpu_machine):
    torch.manual_seed(0)
    m = InPlace().eval()
    x = torch.randn(4, 16)
    g = from_torch(m, (x,), name="inplace")
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    lazy = 0
    try:
        for seed in range(10):
            plan = _random_plan(g, two_gpu_machine, ["cpu", "gpu:0", "gpu:1"], seed)
            cp = be.compile(g, plan)
            assert cp.mutators, "the in-place ops were found"
            assert happens_before_violations(g, plan, cp.sched, cp.reads, cp.writes, cp.mutators) == []
            assert _close(be.execute(g, plan, (x,)), m(x)), f"plan {seed}"
            lazy += sum(len(st.copies_before) for st in cp.sched.steps)
        assert lazy > 0, "values changed in place were copied per reader"
    finally:
        be.close()


def test_visible_gpu_check_names_the_op(branchy, two_gpu_machine):
    _, _, g = branchy
    plan = uniform_plan(g, two_gpu_machine, 1, device="gpu:1")
    problems = visible_gpu_problems(g, plan, visible=1)
    assert problems and "gpu:1" in problems[0] and g.ops[0].id in problems[0]
    assert visible_gpu_problems(g, plan, visible=2) == []
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    be.visible_gpus = 1
    with pytest.raises(PlanError, match=r"gpu:1.*sees 1 CUDA device"):
        be.run(g, plan)
    be.close()


# ======================================================== emulation (CPU)
@pytest.mark.parametrize("policy", ["affinity", "round-robin"])
def test_emulated_runtime_equals_eager_on_mixed_plans(branchy, two_gpu_machine, policy):
    module, inputs, g = branchy
    ref = module(*inputs)
    be = TorchCUDABackend(two_gpu_machine, emulate=True, stream_policy=policy)
    try:
        for seed in range(6):
            devices = [["gpu:0"], ["cpu", "gpu:0"], ["cpu", "gpu:0", "gpu:1"]][seed % 3]
            plan = _random_plan(g, two_gpu_machine, devices, seed)
            assert _close(be.execute(g, plan, inputs), ref), f"plan {seed} ({devices})"
            tr = be.run(g, plan)
            check_trace(tr, g, plan, two_gpu_machine)
            assert tr.meta["emulated"] is True and tr.meta["wall_s"] > 0
            n_cross = len({(e.src, plan[e.dst].device) for e in g.edges
                           if e.bytes > 0 and plan[e.src].device != plan[e.dst].device})
            assert len(tr.meta["copies"]) == n_cross
    finally:
        be.close()


@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_emulated_zoo_models_equal_eager(name, emulated, two_gpu_machine):
    module, inputs = ZOO[name].build(batch=1, width=0.25)
    g = from_torch(module, inputs, name=name)
    ref = module(*inputs)
    for seed in range(2):
        plan = _random_plan(g, two_gpu_machine, ["cpu", "gpu:0", "gpu:1"], seed)
        assert _close(emulated.execute(g, plan, inputs), ref)
        cp = emulated.compile(g, plan)
        assert happens_before_violations(g, plan, cp.sched, cp.reads, cp.writes, cp.mutators) == []
    check_trace(emulated.run(g, plan), g, plan, two_gpu_machine)


def test_emulated_values_are_freed_and_parameters_replicated(branchy, two_gpu_machine):
    module, inputs, g = branchy
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    plan = _random_plan(g, two_gpu_machine, ["cpu", "gpu:0", "gpu:1"], 2)
    cp = be.compile(g, plan)
    assert set(cp.replicas) == set(cp.sched.devices)
    for d in cp.sched.devices:
        if d != "cpu":  # each GPU has its own copy of the module, made once
            assert cp.replicas[d].source.gm is not g.source.gm
            assert be._replica(g.source, d) is cp.replicas[d]
    dropped = {x for st in cp.sched.steps for x in st.drops}
    outs = set(cp.output_slots)
    assert dropped and not any(s in outs or s in cp.input_slots for _, s in dropped)
    assert _close(be.execute(g, plan, inputs), module(*inputs))
    be.close()


def test_failing_op_names_the_op_and_backend_survives(two_gpu_machine):
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.l(x)) + 1

    torch.manual_seed(0)
    m = Boom().eval()
    x = torch.randn(2, 4)
    g = from_torch(m, (x,), name="boom")
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    plan = uniform_plan(g, two_gpu_machine, 1, device="gpu:0")
    with pytest.raises(ExecutionError, match=r"op '.*' on gpu:0 raised"):
        be.execute(g, plan, (torch.randn(2, 5),))  # wrong width: the Linear op fails
    assert _close(be.execute(g, plan, (x,)), m(x))
    be.close()


def test_capture_refuses_mixed_plans_and_emulation(branchy, two_gpu_machine):
    _, inputs, g = branchy
    be = TorchCUDABackend(two_gpu_machine, emulate=True)
    with pytest.raises(PlanError, match="one GPU"):
        be.capture(g, _random_plan(g, two_gpu_machine, ["cpu", "gpu:0"], 0), *inputs)
    with pytest.raises(ExecutionError, match="real GPU"):
        be.capture(g, uniform_plan(g, two_gpu_machine, 1, device="gpu:0"), *inputs)
    be.close()
    with pytest.raises(ExecutionError, match="closed"):
        be.execute(g, uniform_plan(g, two_gpu_machine, 1, device="gpu:0"), inputs)


# ============================================================ errors (CPU)
@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_backend_without_cuda_says_so(two_gpu_machine):
    from opsched.backends.registry import get_backend

    with pytest.raises(ExecutionError, match=r"needs a CUDA GPU.*torch-cpu"):
        TorchCUDABackend(two_gpu_machine)
    with pytest.raises(ExecutionError, match="CUDA"):
        get_backend("torch-cuda", Machine.probe())


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_gpu_profiler_without_cuda_says_so(branchy, two_gpu_machine):
    with pytest.raises(ProfileError, match="needs CUDA"):
        profile_gpu(branchy[2], two_gpu_machine, cache_dir=False, progress=False)


# ===================================================== simulator (CPU)
def test_simulator_prices_cpu_gpu_transfers(two_gpu_machine):
    g = _chain(3)
    m = two_gpu_machine
    plan = Plan.build(g, m, {"o0": Assignment("cpu", 2, 3), "o1": Assignment("gpu:0", 1, 2),
                             "o2": Assignment("cpu", 1, 1)})
    tr = SimBackend(m).run(g, plan)
    ev = tr.by_op()
    assert ev["o1"].start - ev["o0"].end == pytest.approx(m.transfer_time(4e3, "cpu", "gpu:0"))
    assert ev["o2"].start - ev["o1"].end == pytest.approx(m.transfer_time(4e3, "gpu:0", "cpu"))
    assert set(tr.meta["transfer_wait"]) == {"o1", "o2"}
    on_gpu = SimBackend(m).run(g, uniform_plan(g, m, 1, device="gpu:0"))
    assert "transfer_wait" not in on_gpu.meta


def _fake_gpu_profile(graph: OpGraph, machine: Machine, seconds: float = 5e-5) -> Profile:
    gpu = machine.device("gpu:0")
    ops = {op.id: OpProfile(op.id, op.kind, float(op.flops), float(op.bytes_total), tuple(op.shape),
                            {1: (seconds, seconds * 1.1, seconds * 0.9)}) for op in graph.ops}
    settings = {"timer": GPU_TIMER, "device": "gpu:0", "link": {"h2d_gbs": 20.0, "d2h_gbs": 10.0,
                                                                 "h2d_latency_us": 5.0, "d2h_latency_us": 7.0}}
    return Profile(graph.fingerprint(), graph.name, machine.fingerprint(), machine.name,
                   dataclasses.asdict(gpu), (1,), ops, None, settings)


def test_gpu_profile_model_uses_measurements(tmp_path, two_gpu_machine):
    g = _chain(5)
    m = two_gpu_machine
    prof = _fake_gpu_profile(g, m)
    path = gpu_cache_path(g, m, "gpu:0", tmp_path)
    prof.save(path)
    model = GPUProfileModel(Profile.load(path))
    gpu0, cpu = m.device("gpu:0"), m.cpu
    other = dataclasses.replace(gpu0, name="another GPU")
    op = g.ops[0]
    assert model.op_time(op, gpu0, 1) == pytest.approx(5e-5)
    assert model.op_time(op, cpu, 2) == pytest.approx(model.base.op_time(op, cpu, 2))
    assert model.op_time(op, other, 1) == pytest.approx(model.base.op_time(op, other, 1))
    unseen = Op("new", "new", "elementwise", 3e4, 9e3, 9e3)
    ratio = model.op_time(unseen, gpu0, 1) / model.base.op_time(unseen, gpu0, 1)
    assert ratio == pytest.approx(model.kind_factor["elementwise"])
    assert model.transfer_time(2e9, "cpu", "gpu:0", m) == pytest.approx(5e-6 + 0.1)
    assert model.transfer_time(1e9, "gpu:0", "cpu", m) == pytest.approx(7e-6 + 0.1)
    assert model.transfer_time(1e9, "gpu:0", "gpu:1", m) == pytest.approx(m.transfer_time(1e9, "gpu:0", "gpu:1"))
    table = model.time_table(g, m)
    d0 = m.device_index["gpu:0"]
    assert np.allclose(table.times[:, d0, 0], 5e-5)
    # One stream: the simulated makespan of the chain is the sum of the measured times.
    one = dataclasses.replace(m, devices=tuple(dataclasses.replace(d, cores=1) if d.is_gpu else d
                                               for d in m.devices))
    tr = SimBackend(one, model=model).run(g, uniform_plan(g, one, 1, device="gpu:0"))
    assert tr.makespan == pytest.approx(5 * 5e-5)
    with pytest.raises(ProfileError, match="not a GPU profile"):
        GPUProfileModel(dataclasses.replace(prof, settings={}))


# ======================================================= gpu_check.sh (CPU)
@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "check"
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text
    assert "no CUDA GPU" in text
    assert took < 60
    assert not out.exists() or not any(out.iterdir()), "no figures written without a GPU"
    bench = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--out", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert bench.returncode == 3 and "no CUDA GPU" in bench.stdout + bench.stderr


# ====================================================== on a GPU (gpu mark)
@pytest.fixture(scope="module")
def gpu_machine() -> Machine:
    return Machine.probe()


@pytest.fixture(scope="module")
def cuda_backend(gpu_machine):
    be = TorchCUDABackend(gpu_machine)
    yield be
    be.close()


@pytest.fixture
def no_tf32():
    """Full fp32 on the GPU, so GPU outputs compare with CPU ones tightly."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _cpf_plan(graph: OpGraph, machine: Machine, device: str = "gpu:0") -> Plan:
    rank = graph.upward_rank({op.id: max(op.flops, 1.0) for op in graph.ops})
    return uniform_plan(graph, machine, 1, device=device, priority=rank, policy="cpf-gpu")


def _eager_gpu(module, inputs):
    dev = torch.device("cuda:0")
    m = module.to(dev)
    with torch.no_grad():
        out = m(*(x.to(dev) for x in inputs))
    torch.cuda.synchronize()
    module.to("cpu")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ZOO))
def test_gpu_zoo_outputs_equal_eager(name, cuda_backend, gpu_machine, no_tf32):
    module, inputs = ZOO[name].build(batch=2)
    g = from_torch(module, inputs, name=name)
    ref = _eager_gpu(module, inputs)
    cuda_in = tuple(x.cuda() for x in inputs)
    plan = _cpf_plan(g, gpu_machine)
    out = cuda_backend.execute(g, plan, cuda_in)
    assert all(t.is_cuda for t in _flat(out))
    assert _close(out, ref, rtol=1e-4, atol=1e-4), f"{name}: multi-stream outputs differ from eager CUDA"
    check_trace(cuda_backend.run(g, plan, cuda_in), g, plan, gpu_machine)


@pytest.mark.gpu
def test_gpu_single_and_multi_stream_agree(gpu_machine, no_tf32):
    module, inputs = ZOO["inception"].build(batch=1)
    g = from_torch(module, inputs, name="inception")
    ref = _eager_gpu(module, inputs)
    one = dataclasses.replace(gpu_machine, devices=tuple(
        dataclasses.replace(d, cores=1) if d.is_gpu else d for d in gpu_machine.devices))
    cuda_in = tuple(x.cuda() for x in inputs)
    for machine, policy in ((one, "affinity"), (gpu_machine, "affinity"), (gpu_machine, "round-robin")):
        with TorchCUDABackend(machine, stream_policy=policy) as be:
            plan = _cpf_plan(g, machine)
            for _ in range(3):  # repeated runs reuse events, streams and freed memory
                assert _close(be.execute(g, plan, cuda_in), ref, rtol=1e-4, atol=1e-4)
            tr = be.run(g, plan, cuda_in)
            check_trace(tr, g, plan, machine)
            lanes = {e.lane for e in tr.events}
            if machine is one:
                assert lanes == {0}
            elif policy == "round-robin":
                assert lanes == set(range(machine.device("gpu:0").cores))
            else:
                assert len(lanes) > 1, "independent branches run on several streams"


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_gpu_mixed_cpu_gpu_plans_equal_eager(seed, gpu_machine, cuda_backend, branchy, no_tf32):
    module, inputs, g = branchy
    ref = module(*inputs)
    cores = min(2, gpu_machine.cpu.cores)
    plan = _random_plan(g, gpu_machine, ["cpu", "gpu:0"], seed, max_threads=cores)
    assert _close(cuda_backend.execute(g, plan, inputs), ref, rtol=1e-4, atol=1e-4)
    tr = cuda_backend.run(g, plan)
    check_trace(tr, g, plan, gpu_machine, tol=tr.meta["clock_skew_bound_s"] + 50e-6)


@pytest.mark.gpu
def test_gpu_cross_device_copies_on_a_chain(gpu_machine, cuda_backend, no_tf32):
    module, inputs = ZOO["transformer"].build(batch=1, width=0.5)
    g = from_torch(module, inputs, name="transformer")
    ref = module(*inputs)
    topo = list(g.topo_index)
    # Alternate blocks of ops between the CPU and the GPU: many copies both ways.
    plan = Plan.build(g, gpu_machine, {
        g.ops[i].id: Assignment("gpu:0" if (k // 7) % 2 else "cpu", 1, float(len(topo) - k))
        for k, i in enumerate(topo)})
    out = cuda_backend.execute(g, plan, inputs)
    assert _close(out, ref, rtol=1e-4, atol=1e-4)
    tr = cuda_backend.run(g, plan)
    assert {c["src"] for c in tr.meta["copies"]} == {"cpu", "gpu:0"}
    check_trace(tr, g, plan, gpu_machine, tol=tr.meta["clock_skew_bound_s"] + 50e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 if HAS_CUDA else True, reason="needs two GPUs")
def test_gpu_multi_gpu_placement_equals_eager(gpu_machine, cuda_backend, no_tf32):
    from opsched.policies import get_policy

    module, inputs = ZOO["inception"].build(batch=2)
    g = from_torch(module, inputs, name="inception")
    ref = _eager_gpu(module, inputs)
    gpus = [d.id for d in gpu_machine.gpus]
    for plan in (_random_plan(g, gpu_machine, gpus, 0), get_policy("maestro").plan(g, gpu_machine)):
        assert _close(cuda_backend.execute(g, plan, tuple(x.cuda() for x in inputs)), ref, rtol=1e-4, atol=1e-4)
        tr = cuda_backend.run(g, plan)
        check_trace(tr, g, plan, gpu_machine, tol=tr.meta["clock_skew_bound_s"] + 50e-6)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_equals_eager(gpu_machine, cuda_backend, no_tf32):
    module, inputs = ZOO["nasnet"].build(batch=1)
    g = from_torch(module, inputs, name="nasnet")
    ref = _eager_gpu(module, inputs)
    cuda_in = tuple(x.cuda() for x in inputs)
    cap = cuda_backend.capture(g, _cpf_plan(g, gpu_machine), *cuda_in)
    out = cap.replay(*cuda_in)
    torch.cuda.synchronize()
    assert _close(out, ref, rtol=1e-4, atol=1e-4)
    other = tuple(torch.randn_like(x) for x in cuda_in)
    out2 = [t.clone() for t in _flat(cap.replay(*other))]
    torch.cuda.synchronize()
    assert _close(out2, _eager_gpu(module, tuple(x.cpu() for x in other)), rtol=1e-4, atol=1e-4)
    mixed = _random_plan(g, gpu_machine, ["cpu", "gpu:0"], 0)
    with pytest.raises(PlanError, match="one GPU"):
        cuda_backend.capture(g, mixed, *cuda_in)


@pytest.mark.gpu
def test_gpu_errors_name_the_device_and_op(gpu_machine, cuda_backend, branchy):
    _, inputs, g = branchy
    n = torch.cuda.device_count()
    big = Machine("too-many-gpus", (gpu_machine.cpu,) + tuple(
        Device(f"gpu:{i}", "gpu", 4, 20000.0, 1000.0, 16.0) for i in range(n + 1)),
        tuple(Link("cpu", f"gpu:{i}", 12.0, 10.0) for i in range(n + 1)))
    with TorchCUDABackend(big) as be, pytest.raises(PlanError, match=rf"gpu:{n}.*sees {n} CUDA device"):
        be.run(g, uniform_plan(g, big, 1, device=f"gpu:{n}"))
    with pytest.raises(ExecutionError, match="raised"):
        cuda_backend.execute(g, _cpf_plan(g, gpu_machine), (torch.randn(2, 5, 16, 16).cuda(),))


@pytest.mark.gpu
def test_gpu_profiler_feeds_the_model(tmp_path, gpu_machine, branchy):
    _, _, g = branchy
    prof = profile_gpu(g, gpu_machine, cache_dir=tmp_path, progress=False, repeats=5)
    assert set(prof.ops) == {op.id for op in g.ops}
    assert all(p.median[1] > 0 for p in prof.ops.values())
    assert prof.settings["timer"] == GPU_TIMER and prof.settings["link"]["h2d_gbs"] > 0
    again = profile_gpu(g, gpu_machine, cache_dir=tmp_path, progress=False)
    assert again.to_dict() == prof.to_dict(), "second call reads the cache"
    model = GPUProfileModel(again)
    gpu0 = gpu_machine.device("gpu:0")
    op = g.ops[0]
    assert model.time_table(g, gpu_machine).times[0, gpu_machine.device_index["gpu:0"], 0] == \
        pytest.approx(prof.ops[op.id].median[1])
    tr = SimBackend(gpu_machine, model=model).run(g, _cpf_plan(g, gpu_machine))
    assert tr.makespan >= max(p.median[1] for p in prof.ops.values())
    assert model.matches(gpu0)



@pytest.mark.gpu
def test_gpu_apply_schedules_through_the_one_pipeline(no_tf32):
    """opsched.apply(..., backend="torch-cuda"): the same pipeline and adapter as torch-cpu,
    outputs checked once against the CPU module."""
    from opsched.scheduled import apply

    module, inputs = ZOO["randwire"].build(batch=2, width=0.5)
    sm = apply("critical-path-first", module, inputs, backend="torch-cuda", measure=0)
    assert sm.scheduled, sm.fallback_reason
    with torch.no_grad():
        out, ref = sm(*inputs), module(*inputs)
    assert _close(out, ref, rtol=1e-3, atol=1e-4)
