"""TorchCPUBackend: outputs equal eager, plan semantics on real threads,
failures and Ctrl-C leave nothing hung, clean shutdown.  (The trace contract
itself is in test_backend_contract.py.)"""

from __future__ import annotations

import _thread
import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.fx
from torch import nn

from opsched.backends.executor import CompiledPlan, OpFailure, WorkerPool
from opsched.backends.torch_cpu import TorchCPUBackend, recommended_env
from opsched.errors import ExecutionError, PlanError
from opsched.graph import OpGraph
from opsched.importers.torch_fx import from_torch
from opsched.machine import PRESETS, Machine
from opsched.plan import Assignment, Plan, uniform_plan
from opsched.zoo import ZOO


def _machine(cores: int) -> Machine:
    probe = Machine.probe()
    return Machine(f"test-{cores}c", (dataclasses.replace(probe.cpu, cores=cores),))


def _flat(x):
    return list(torch.utils._pytree.tree_leaves(x))


def _random_plan(graph: OpGraph, machine: Machine, seed: int) -> Plan:
    rng = random.Random(seed)
    cores = machine.cpu.cores
    return Plan.build(graph, machine, {op.id: Assignment("cpu", rng.randint(1, cores), rng.random())
                                       for op in graph.ops}, policy=f"random-{seed}")


def _eager(module, inputs, threads: int):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            return module(*inputs)
    finally:
        torch.set_num_threads(prev)


# ------------------------------------------------------------ test modules
_state = {"boom": False, "slow_calls": 0}


@torch.fx.wrap
def _boom(x):
    if _state["boom"]:
        raise ValueError("boom: deliberate failure")
    return x


@torch.fx.wrap
def _slow(x):
    time.sleep(0.05)  # releases the GIL, like a real kernel
    _state["slow_calls"] += 1
    return x + 1


class Raiser(nn.Module):
    """Two branches; one holds a slow op, the other an op that may raise."""

    def forward(self, x):
        a = _slow(x * 2)
        b = _boom(torch.relu(x))
        return a + b


class SlowFan(nn.Module):
    """Many independent slow ops: a long run to interrupt."""

    def __init__(self, n: int = 40) -> None:
        super().__init__()
        self.n = n

    def forward(self, x):
        outs = [_slow(x * (i + 1)) for i in range(self.n)]
        return torch.stack(outs).sum(0)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 16, 3, padding=1)
        self.c2 = nn.Conv2d(4, 16, 1)
        self.fc = nn.Linear(16 * 8 * 8, 8)

    def forward(self, x):
        y = torch.relu(self.c1(x)) + torch.sigmoid(self.c2(x))
        return self.fc(y.flatten(1)), y.mean()


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    m = Small().eval()
    inputs = (torch.randn(2, 4, 8, 8),)
    return m, inputs, from_torch(m, inputs, name="small")


@pytest.fixture(scope="module")
def be2():
    with TorchCPUBackend(_machine(2)) as be:
        yield be


def _workers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("opsched-torch-cpu")]


# ------------------------------------------------------------- correctness
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_outputs_equal_eager(name):
    """Random co-running plans are allclose to eager; a plan at eager's thread
    count on the executor threads is bit-exact."""
    module, inputs = ZOO[name].build(batch=1, width=0.25)
    graph = from_torch(module, inputs, name=name)
    ref = _flat(_eager(module, inputs, 2))
    with TorchCPUBackend(_machine(2)) as be:
        out = _flat(be.execute(graph, _random_plan(graph, be.machine, 1), inputs))
        assert len(out) == len(ref)
        for a, b in zip(out, ref):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name
    with TorchCPUBackend(_machine(4)) as be4:  # threads=2 on 4 slots: two ops side by side on workers
        plan = uniform_plan(graph, be4.machine, 2)
        out = _flat(be4.execute(graph, plan, inputs))
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), f"{name}: not bit-exact at eager's thread count"


def test_inline_plan_is_bit_exact_and_traced(small, be2):
    m, inputs, g = small
    ref = _flat(_eager(m, inputs, 2))
    plan = uniform_plan(g, be2.machine, 2)
    out = _flat(be2.execute(g, plan, inputs))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    tr = be2.run(g, plan, inputs)
    assert tr.meta["mode"] == "inline" and tr.meta["wall_s"] >= tr.makespan > 0
    assert {e.cores for e in tr.events} == {(0, 1)}


def test_executor_threads_record_cores_lanes_and_wall(small, be2):
    m, inputs, g = small
    plan = uniform_plan(g, be2.machine, 1)
    tr = be2.run(g, plan, inputs)
    assert tr.meta["mode"] == "pool" and tr.backend == "torch-cpu"
    assert tr.meta["wall_s"] >= tr.makespan > 0
    assert all(len(e.cores) == 1 and e.lane is not None and e.lane >= 0 for e in tr.events)
    if tr.meta["pinned"]:
        assert tr.meta["pin_note"] == ""
    else:
        assert tr.meta["pin_note"], "an unpinned run says why"


def test_multi_threaded_ops_run_on_the_calling_thread_one_thread_ops_on_workers(small):
    """One OpenMP team per process: the caller runs every multi-threaded op (lane -1),
    workers only one-thread ops; outputs still equal eager, also with two wide ops side by side."""
    m, inputs, g = small
    ref = m(*inputs)
    with TorchCPUBackend(_machine(4)) as be:
        n = len(g.ops)
        for k_wide in (2, 4):  # 4: a wide op takes every slot; 2: two wide ops may co-run
            plan = Plan.build(g, be.machine, {op.id: Assignment("cpu", k_wide if i % 2 else 1, float(n - i))
                                              for i, op in enumerate(g.ops)})
            tr = be.run(g, plan, inputs)
            assert tr.meta["mode"] == "pool"
            wide = [e for e in tr.events if e.threads > 1]
            assert wide and all(e.lane >= 0 for e in tr.events if e.threads == 1)
            on_caller = [e for e in wide if e.lane == -1]
            if k_wide == 4:  # never two at once: all on the caller
                assert len(on_caller) == len(wide)
            else:
                assert on_caller, "the calling thread takes the multi-threaded ops"
            out = be.execute(g, plan, inputs)
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(_flat(out), _flat(ref)))


def _affinity_of_workers_that_ran(be: TorchCPUBackend, tr) -> list[set[int]]:
    workers = be.workers
    return [os.sched_getaffinity(workers[w].native_id) for w in sorted({e.lane for e in tr.events if e.lane >= 0})]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs sched_setaffinity and 2 usable CPUs")
@pytest.mark.parametrize("pin", [True, "always"])
def test_workers_run_unpinned_in_plans_with_multi_threaded_ops(small, pin):
    """Issue 3: after each parallel region the caller's OpenMP helpers spin on
    cores the kernel chose, so with pin=True workers of plans with multi-threaded
    ops run on every CPU (the kernel places them on an idle one); one-thread plans
    stay pinned; pin='always' pins in both.  Outputs equal eager either way."""
    m, inputs, g = small
    ref = _flat(_eager(m, inputs, 2))
    everywhere = os.sched_getaffinity(0)
    with TorchCPUBackend(_machine(2), pin=pin) as be:
        one_thread = uniform_plan(g, be.machine, 1)
        n = len(g.ops)
        mixed = Plan.build(g, be.machine, {op.id: Assignment("cpu", 2 if i % 2 else 1, float(n - i))
                                           for i, op in enumerate(g.ops)})
        for plan, pinned in ((one_thread, True), (mixed, pin == "always"), (one_thread, True)):
            tr = be.run(g, plan, inputs)
            if not be._pool.pinned:
                pytest.skip(f"pinning not permitted here: {tr.meta['pin_note']}")
            assert tr.meta["mode"] == "pool" and tr.meta["pinned"] is pinned
            affinities = _affinity_of_workers_that_ran(be, tr)
            assert affinities, "some one-thread op ran on a worker"
            if pinned:
                assert tr.meta["cpus"] and all(len(a) == 1 for a in affinities), affinities
            else:
                assert "multi-threaded" in tr.meta["pin_note"] and tr.meta["cpus"] is None
                assert all(a == everywhere for a in affinities), affinities
            out = _flat(be.execute(g, plan, inputs))
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(out, ref))


def test_pin_must_be_true_false_or_always():
    with pytest.raises(ValueError, match="pin must be True, False or 'always'"):
        TorchCPUBackend(_machine(2), pin="sometimes")


def test_different_inputs_and_repeated_runs(small, be2):
    m, _, g = small
    plan = _random_plan(g, be2.machine, 5)
    for seed in range(3):
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
        ref = _flat(_eager(m, (x,), 2))
        out = _flat(be2.execute(g, plan, (x,)))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(out, ref))


def test_caller_thread_count_is_restored(small, be2):
    m, inputs, g = small
    before = torch.get_num_threads()
    for k in (1, 2):
        be2.run(g, uniform_plan(g, be2.machine, k), inputs)
        _eager(m, inputs, before)  # a conv in the caller must not fall back to a worker's count
        assert torch.get_num_threads() == before


def test_compiled_plan_is_cached(small, be2):
    _, _, g = small
    plan = uniform_plan(g, be2.machine, 1)
    assert be2.compile(g, plan) is be2.compile(g, plan)


# ------------------------------------------------------------------ errors
def test_plans_the_backend_cannot_run_are_refused(small):
    _, inputs, g = small
    machine = PRESETS["dgx1-4v100"]
    with TorchCPUBackend(machine, pin=False) as be:
        asg = {op.id: Assignment("cpu", 1, 0.0) for op in g.ops}
        asg[g.ops[1].id] = Assignment("gpu:0", 1, 0.0)
        with pytest.raises(PlanError, match=f"op {g.ops[1].id!r} is placed on 'gpu:0'"):
            be.run(g, Plan.build(g, machine, asg))
    loaded = OpGraph.from_dict(g.to_dict())  # JSON round trip: no executable source
    with TorchCPUBackend(_machine(2)) as be, pytest.raises(ExecutionError, match="no PyTorch source"):
        be.run(loaded, uniform_plan(loaded, be.machine, 1))


@pytest.mark.parametrize("threads", [1, 2])
def test_raising_op_names_the_op_and_leaves_nothing_hung(be2, threads):
    x = torch.randn(4, 4)
    g = from_torch(Raiser(), (x,), name="raiser")
    plan = uniform_plan(g, be2.machine, threads)  # 1: the pool (slow op co-runs), 2: inline
    boom_op = next(op.id for op in g.ops if "_boom" in g.source.op_nodes[op.id][0])
    _state["boom"] = True
    try:
        with pytest.raises(ExecutionError, match=f"op {boom_op!r}.*fx node.*_boom.*ValueError: boom") as info:
            be2.run(g, plan)
        assert isinstance(info.value.__cause__, ValueError)
    finally:
        _state["boom"] = False
    workers = _workers_alive()
    out = be2.execute(g, plan, (x,))  # the backend still works
    assert torch.allclose(out, (x * 2 + 1) + torch.relu(x))
    assert _workers_alive() == workers, "no worker was lost or added"


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this test, as in a shell's foreground job.

    A background job (``pytest ... &``, ``nohup``, ``setsid``, ``trap '' INT``)
    starts with SIGINT ignored; Python then installs no handler, and both
    ``_thread.interrupt_main()`` and a real SIGINT do nothing -- the test would
    check nothing.  The handler is Python's own default, restored afterwards."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


#: ``python -c FOREGROUND script.py`` runs the script as ``python script.py`` run
#: from a shell's foreground would (in ``__main__``, its globals alive until exit),
#: with Python's default SIGINT handler even when this test run ignores SIGINT.
FOREGROUND = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv = sys.argv[1:]; __file__ = sys.argv[0]; "
              "exec(compile(open(__file__).read(), __file__, 'exec'))")


@pytest.mark.parametrize("cores", [1, 2])
def test_ctrl_c_stops_dispatch_and_waits_for_running_ops(cores, ctrl_c_raises):
    g = from_torch(SlowFan(20), (torch.ones(3),), name="slowfan")
    with TorchCPUBackend(_machine(cores)) as be:
        workers = be.workers
        plan = uniform_plan(g, be.machine, 1)
        be.run(g, plan)  # warm: threads started, plan compiled
        _state["slow_calls"] = 0
        timer = threading.Timer(0.2, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                be.run(g, plan)
        finally:
            timer.cancel()
            timer.join()
        ran = _state["slow_calls"]
        assert 0 < ran < 20, "dispatch stopped early"
        time.sleep(0.15)
        assert _state["slow_calls"] == ran, "an op was still running after the interrupt returned"
        out = be.execute(g, plan, (torch.ones(3),))  # the backend still works
        assert torch.equal(out, sum(torch.ones(3) * (i + 1) + 1 for i in range(20)))
    assert not any(t.is_alive() for t in workers)


def test_close_joins_workers_and_is_idempotent(small):
    _, inputs, g = small
    be = TorchCPUBackend(_machine(2))
    be.run(g, uniform_plan(g, be.machine, 1), inputs)
    assert be.workers and all(t.is_alive() for t in be.workers)
    workers = be.workers
    be.close()
    be.close()
    assert not any(t.is_alive() for t in workers)
    assert not [t for t in _workers_alive() if t in workers]
    with pytest.raises(ExecutionError, match="closed"):
        be.run(g, uniform_plan(g, be.machine, 1), inputs)


def test_a_forgotten_backend_stops_its_workers_when_collected(small):
    import gc

    _, inputs, g = small
    be = TorchCPUBackend(_machine(2))
    be.run(g, uniform_plan(g, be.machine, 1), inputs)
    workers = be.workers
    assert workers
    del be
    gc.collect()
    for t in workers:
        t.join(10)
    assert not any(t.is_alive() for t in workers)


_SUBPROCESS = textwrap.dedent("""
    import dataclasses, os, signal, threading, time
    import torch, torch.fx
    from torch import nn
    from opsched.backends.torch_cpu import TorchCPUBackend
    from opsched.importers.torch_fx import from_torch
    from opsched.machine import Machine
    from opsched.plan import uniform_plan

    @torch.fx.wrap
    def slow(x):
        time.sleep(0.05)
        return x + 1

    class Fan(nn.Module):
        def forward(self, x):
            return torch.stack([slow(x * (i + 1)) for i in range(30)]).sum(0)

    probe = Machine.probe()
    machine = Machine("sub-2c", (dataclasses.replace(probe.cpu, cores=2),))
    g = from_torch(Fan(), (torch.ones(2),))
    be = TorchCPUBackend(machine)
    plan = uniform_plan(g, machine, 1)
    be.run(g, plan)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        be.run(g, plan)
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    print("result ok", bool(torch.equal(be.execute(g, plan, (torch.ones(2),)), sum(torch.ones(2) * (i + 1) + 1 for i in range(30)))))
    forgotten = TorchCPUBackend(machine)  # never closed: exit must not hang on its workers
    forgotten.run(g, plan)
    print("exiting")
""")


def test_real_sigint_and_forgotten_backend_in_a_subprocess(tmp_path):
    script = tmp_path / "sigint_child.py"
    script.write_text(_SUBPROCESS)
    proc = subprocess.run([sys.executable, "-c", FOREGROUND, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["interrupted", "result", "ok", "True", "exiting"], proc.stdout


def test_recommended_env_names_the_malloc_thresholds():
    env = recommended_env()
    assert set(env) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
    assert all(v.isdigit() and int(v) >= 32 * 1024 * 1024 for v in env.values())


# ------------------------------------------ executor semantics (plain callables)
def _py_plan(n_slots: int, threads: list[int], prio: list[float], deps: list[list[int]], fns) -> CompiledPlan:
    order = sorted(range(len(threads)), key=lambda i: (-prio[i], i))
    return CompiledPlan([f"op{i}" for i in range(len(threads))], fns, threads, order, deps, n_slots)


def test_pool_follows_priority_order_on_one_slot():
    ran: list[int] = []
    n = 12
    rng = random.Random(1)
    prio = [float(rng.randint(0, 4)) for _ in range(n)]
    deps = [[j for j in range(i) if rng.random() < 0.2] for i in range(n)]
    fns = [(lambda k: lambda v: ran.append(k))(i) for i in range(n)]
    cp = _py_plan(2, [2] * n, prio, deps, fns)
    assert cp.serial_order is not None
    pool = WorkerPool(2)
    try:
        pool.run(cp, [])  # the pool path (not the inline one) must give the same single order
    finally:
        pool.close()
    assert ran == cp.serial_order
    # the reference: highest-priority ready op first, ties in index order
    done: set[int] = set()
    expect = []
    while len(expect) < n:
        ready = [i for i in range(n) if i not in done and all(d in done for d in deps[i])]
        pick = min(ready, key=lambda i: (-prio[i], i))
        expect.append(pick)
        done.add(pick)
    assert ran == expect


def test_pool_backfills_ops_that_fit_and_holds_those_that_do_not():
    """A (1 thread, top priority) starts; B needs both slots so waits; C fits in
    the remaining slot and starts beside A; B starts when both are done."""
    def sleeper(v):
        time.sleep(0.2)

    cp = _py_plan(2, [1, 2, 1], [3.0, 2.0, 1.0], [[], [], []], [sleeper, sleeper, sleeper])
    pool = WorkerPool(2)
    try:
        run = pool.run(cp, [])
    finally:
        pool.close()
    (_, sb, sc), (ea, _, ec) = run.starts, run.ends
    assert sc < ea, "C should co-run with A"
    assert sb >= max(ea, ec), "B must wait for two free slots"
    assert set(run.cores[0] + run.cores[2]) == {0, 1} and run.cores[1] == (0, 1)


def test_pool_frees_intermediate_values_but_keeps_protected_ones():
    # slot 0 input, 1 = op0(0), 2 = op1(1), 3 = op2(1, 2) is the output
    def op0(v):
        v[1] = v[0] + 1

    def op1(v):
        v[2] = v[1] * 2

    def op2(v):
        v[3] = v[1] + v[2]

    reads, writes = [(0,), (1,), (1, 2)], [(1,), (2,), (3,)]
    cp = CompiledPlan(["a", "b", "c"], [op0, op1, op2], [1, 1, 1], [0, 1, 2], [[], [0], [0, 1]], 2,
                      reads, writes, protected={0, 3})
    pool = WorkerPool(2)
    try:
        values = [1, None, None, None]
        pool.run(cp, values)
    finally:
        pool.close()
    assert values == [1, None, None, 2 + 4]


def _co_running_teams(pool: WorkerPool, threads: int) -> list[threading.Thread]:
    """Run two independent ``threads``-thread matmul ops side by side on ``pool`` (4 slots);
    return the threads that ran them (the caller runs one, a worker the other)."""
    who: list[threading.Thread] = []
    a = torch.randn(64, 64)

    def op(v):
        who.append(threading.current_thread())
        a @ a @ a  # a parallel region at the op's thread count: a multi-threaded op opens a team

    before = torch.get_num_threads()
    try:
        pool.run(_py_plan(4, [threads, threads], [1.0, 0.0], [[], []], [op, op]), [])
    finally:
        torch.set_num_threads(before)
    return [t for t in who if t is not threading.current_thread()]


@pytest.mark.parametrize("retire", [True, False])
def test_a_worker_that_ran_a_multi_threaded_op_exits_when_the_run_ends(retire):
    """Its OpenMP team would outlive the op and make libgomp throttle every later parallel region
    of the process (eager PyTorch's too: ~2x here, bench/omp_teams.py); retire_teams=False keeps
    it, which is how this test fails if the retirement stops happening."""
    pool = WorkerPool(4, set_threads=torch.set_num_threads, get_threads=torch.get_num_threads,
                      retire_teams=retire)
    try:
        workers = _co_running_teams(pool, 2)
        assert len(workers) == 1, "the second multi-threaded op runs on a worker"
        workers[0].join(timeout=10)
        assert workers[0].is_alive() is not retire
        assert workers[0] not in pool.threads if retire else workers[0] in pool.threads
        again = _co_running_teams(pool, 2)  # the pool still serves co-running multi-threaded ops
        assert len(again) == 1 and (again[0] is not workers[0]) is retire
        assert len(pool.threads) <= pool.slots
    finally:
        pool.close()
    assert not any(t.is_alive() for t in pool.threads)


def test_workers_that_ran_one_thread_ops_only_are_kept():
    """No team, nothing to retire: a pool running one-thread ops reuses its threads."""
    pool = WorkerPool(4, set_threads=torch.set_num_threads, get_threads=torch.get_num_threads)
    try:
        first = _co_running_teams(pool, 1)
        second = _co_running_teams(pool, 1)
        assert first and second and set(first) | set(second) <= set(pool.threads)
        assert all(t.is_alive() for t in first)
    finally:
        pool.close()


def test_pool_reports_the_failing_op_and_survives():
    def bad(v):
        raise RuntimeError("nope")

    cp = _py_plan(2, [1, 1, 1], [1.0, 1.0, 1.0], [[], [0], [1]], [lambda v: None, bad, lambda v: None])
    pool = WorkerPool(2)
    try:
        with pytest.raises(OpFailure) as info:
            pool.run(cp, [])
        assert info.value.index == 1 and isinstance(info.value.exc, RuntimeError)
        ok = _py_plan(2, [1], [0.0], [[]], [lambda v: v.append(1)])
        vals: list = []
        pool.run(ok, vals)
        assert vals == [1]
    finally:
        pool.close()
    assert not any(t.is_alive() for t in pool.threads)
