"""The ``ort`` backend (issue 16): ONNX models imported as the graph ONNX Runtime
runs, plans lowered to co-running sessions whose outputs equal ONNX Runtime's
sequential run, clear errors, no hung threads, its runtime model and profiles,
and ``opsched.apply`` / ``opsched apply`` on it."""

from __future__ import annotations

import _thread
import dataclasses
import gc
import json
import random
import signal
import threading
import time
import warnings

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper  # noqa: E402

from opsched.backends.ort_backend import OrtBackend  # noqa: E402
from opsched.backends.ort_lower import choose_plan, lower, single_session_plan  # noqa: E402
from opsched.engine.models.ort_runtime import OrtRuntime  # noqa: E402
from opsched.engine.models.runtime import PlanningModel  # noqa: E402
from opsched.errors import ExecutionError, PlanError  # noqa: E402
from opsched.importers.onnx_graph import from_onnx, from_torch_via_onnx, op_kind  # noqa: E402
from opsched.machine import Machine  # noqa: E402
from opsched.plan import Assignment, Plan, uniform_plan  # noqa: E402


def _machine(cores: int, name: str | None = None) -> Machine:
    cpu = dataclasses.replace(Machine.probe().cpu, cores=cores)
    return Machine(name or f"ort-test-{cores}c", (cpu,), description="ort test machine")


def _lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("opsched-ort-lane")]


def _model(nodes, inputs, outputs, inits=()) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _fan(chains: int = 2, length: int = 3, n: int = 64) -> bytes:
    """``chains`` independent MatMul+Relu chains from one input, summed: room to co-run."""
    rng = np.random.default_rng(0)
    nodes, inits, heads = [], [], []
    for c in range(chains):
        x = "x"
        for k in range(length):
            w = f"w{c}_{k}"
            inits.append(helper.make_tensor(w, TensorProto.FLOAT, [n, n], (rng.standard_normal((n, n)) / n).ravel()))
            nodes += [helper.make_node("MatMul", [x, w], [f"m{c}_{k}"], name=f"mm{c}_{k}"),
                      helper.make_node("Relu", [f"m{c}_{k}"], [f"r{c}_{k}"], name=f"relu{c}_{k}")]
            x = f"r{c}_{k}"
        heads.append(x)
    nodes.append(helper.make_node("Sum", heads, ["y"], name="sum"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, n])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, n])], inits)


@pytest.fixture(scope="module")
def fan():
    return from_onnx(_fan(), name="fan", opt_level="disable")


@pytest.fixture(scope="module")
def be2():
    with OrtBackend(_machine(2)) as be:
        yield be


def _reference(graph, inputs):
    from opsched.adapters.onnx import reference_session, run_reference

    return run_reference(reference_session(graph), graph, inputs)


def _plans(graph, machine) -> dict[str, Plan]:
    rng = random.Random(5)
    cores = machine.cpu.cores
    topo = [graph.ops[i].id for i in graph.topo_index]
    mixed = {op.id: Assignment("cpu", rng.randint(1, cores), rng.random()) for op in graph.ops}
    waits = {op_id: dataclasses.replace(a, after=tuple(rng.sample(topo[:k], min(2, k))) if k and rng.random() < 0.4
                                        else ()) for k, (op_id, a) in enumerate((o, mixed[o]) for o in topo)}
    return {"all-cores": uniform_plan(graph, machine, cores), "one-thread": uniform_plan(graph, machine, 1),
            "mixed": Plan.build(graph, machine, mixed), "after": Plan.build(graph, machine, waits)}


# ------------------------------------------------------------------ importer
def test_import_is_the_graph_onnx_runtime_runs(fan):
    assert len(fan.ops) == 13 and {op.kind for op in fan.ops} == {"matmul", "elementwise"}
    mm = fan.op("mm0_0")
    assert mm.flops == 2 * 8 * 64 * 64 and mm.param_bytes == 64 * 64 * 4 and mm.shape == (8, 64)
    assert mm.bytes_read == (8 * 64 + 64 * 64) * 4 and mm.bytes_written == 8 * 64 * 4
    assert {(e.src, e.dst) for e in fan.edges} >= {("mm0_0", "relu0_0"), ("relu0_2", "sum"), ("relu1_2", "sum")}
    assert fan.meta["framework"] == "onnx" and fan.width() == 2
    optimised = from_onnx(_fan(), name="fan")  # ORT fuses MatMul+Relu? whatever it does, the graph follows it
    assert len(optimised.ops) <= len(fan.ops)


def test_torch_export_import_is_deterministic_and_kinds_map():
    from _nets import Branchy

    torch.manual_seed(0)
    m, x = Branchy().eval(), torch.randn(2, 3, 16, 16)
    a, b = from_torch_via_onnx(m, (x,), name="branchy"), from_torch_via_onnx(m, (x,), name="branchy")
    assert a.fingerprint() == b.fingerprint() and len({op.id for op in a.ops}) == len(a.ops)
    assert "conv" in {op.kind for op in a.ops}
    assert op_kind("Conv") == "conv" and op_kind("FusedMatMul") == "matmul" and op_kind("Concat") == "concat_split"
    assert op_kind("SkipLayerNormalization") == "norm" and op_kind("Softmax") == "reduce"


def test_onnx_specs_load(tmp_path):
    from opsched.specs import load_graph, load_model

    path = tmp_path / "fan.onnx"
    path.write_bytes(_fan())
    loaded = load_model(str(path), batch=1)
    assert loaded.framework == "onnx" and loaded.name == "fan" and loaded.inputs[0].shape == (8, 64)
    g = load_graph(str(path))
    assert g.source is not None and g.meta["framework"] == "onnx"


# ------------------------------------------------------------------ lowering
def test_lowering_puts_two_chains_on_two_lanes(fan):
    from opsched.engine.models.analytic import AnalyticModel

    machine = _machine(2)
    low = lower(fan, uniform_plan(fan, machine, 1), machine, AnalyticModel())
    assert sum(1 for lane in low.lanes if lane) == 2 and not low.single
    for s in low.segments:
        assert s.threads == 1 and len(s.held) == 1
        ops = {fan.ops[i].id for i in s.ops}
        assert not ({"mm0_0", "mm1_0"} <= ops), "the two chains are on different lanes"
    whole = lower(fan, uniform_plan(fan, machine, 2), machine, AnalyticModel())
    assert whole.single and whole.segments[0].threads == 2 and whole.segments[0].held == (0, 1)


def test_choose_plan_keeps_a_faster_plan_else_one_session(fan):
    from opsched.engine.models.analytic import AnalyticModel

    machine = _machine(2)
    slow = OrtRuntime(handoff_s=1.0)  # every hand-off costs a second: nothing beats one session
    from opsched.engine.models.runtime import PlanningModel

    plan = uniform_plan(fan, machine, 1, policy="one-thread")
    chosen = choose_plan(fan, plan, machine, PlanningModel(AnalyticModel(), slow))
    assert chosen.policy == "ort-single" and chosen.meta["instead_of"] == "one-thread"
    assert chosen.assignments == single_session_plan(fan, machine).assignments


# ------------------------------------------------------------------ execution
@pytest.mark.parametrize("kind", ["all-cores", "one-thread", "mixed", "after"])
def test_outputs_equal_onnx_runtime_sequential(fan, be2, kind):
    plan = _plans(fan, be2.machine)[kind]
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    got = be2.execute(fan, plan, (x,))
    want = _reference(fan, (x,))
    assert len(got) == len(want) and np.allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    trace = be2.run(fan, plan)
    assert trace.meta["op_times"] == "apportioned" and trace.meta["wall_s"] > 0


def test_zoo_model_outputs_equal_sequential_under_co_running_plans():
    from opsched.policies import get_policy
    from opsched.specs import load_onnx_graph

    g = load_onnx_graph("zoo:randwire", width=0.25, cache_dir=None)
    machine = _machine(2)
    with OrtBackend(machine) as be:
        want = _reference(g, g.source.example_inputs)
        for plan in (uniform_plan(g, machine, 1), get_policy("random", seed=3).plan(g, machine)):
            got = be.execute(g, plan, g.source.example_inputs)
            assert all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want))
            assert be.compile(g, plan).lowering.cross_waits > 0, "the plan co-runs"


def test_plans_for_another_graph_or_machine_or_device_are_refused(fan, be2):
    other = from_onnx(_fan(3), name="fan3", opt_level="disable")
    with pytest.raises(PlanError, match="different graph"):
        be2.run(fan, uniform_plan(other, be2.machine, 1))
    with pytest.raises(PlanError, match="different machine"):
        be2.run(fan, uniform_plan(fan, _machine(3, "other"), 1))
    with pytest.raises(ExecutionError, match="no ONNX source"):
        loaded = type(fan).from_dict(fan.to_dict())
        be2.run(loaded, uniform_plan(loaded, be2.machine, 1))


def _gather_model() -> bytes:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gather", ["r", "idx"], ["g"], axis=0, name="pick_rows"),
             helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
             helper.make_node("ReduceSum", ["s"], ["t"], keepdims=0, name="total")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
                          helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
                  [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 3]),
                   helper.make_tensor_value_info("t", TensorProto.FLOAT, [])])


@pytest.mark.parametrize("threads", [1, 2])
def test_failing_node_is_named_and_nothing_hangs(be2, threads):
    g = from_onnx(_gather_model(), name="gather", opt_level="disable")
    plan = uniform_plan(g, be2.machine, threads)  # 1: two lanes, 2: one session
    x = np.ones((4, 3), np.float32)
    be2.run(g, plan, (x, np.array([0, 1])))
    lanes = _lane_threads()
    with pytest.raises(ExecutionError, match=r"node 'pick_rows' \(Gather\) raised") as info:
        be2.execute(g, plan, (x, np.array([0, 9])))  # row 9 of 4
    assert info.value.__cause__ is not None
    out = be2.execute(g, plan, (x, np.array([3, 2])))  # the backend still works
    assert np.allclose(out[0], 1.0) and np.isclose(out[1], 12 / (1 + np.exp(-1)))
    assert _lane_threads() == lanes, "no lane thread was lost or added"


def test_inputs_of_another_shape_are_a_clear_error(fan, be2):
    with pytest.raises(ExecutionError, match=r"input 'x' is float32\[4, 64\]; the graph was imported for"):
        be2.execute(fan, uniform_plan(fan, be2.machine, 1), (np.zeros((4, 64), np.float32),))


def _slow_fan() -> bytes:
    return _fan(chains=2, length=40, n=384)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here even when the test run ignores it (see test_torch_cpu)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_stops_the_lanes_and_leaves_nothing_hung(ctrl_c_raises):
    g = from_onnx(_slow_fan(), name="slowfan", opt_level="disable")
    with OrtBackend(_machine(2)) as be:
        plan = uniform_plan(g, be.machine, 1)
        t0 = time.perf_counter()
        be.run(g, plan)  # warm: sessions built, lane threads started
        one = time.perf_counter() - t0
        workers = be.workers
        assert workers and all(t.is_alive() for t in workers)
        timer = threading.Timer(min(0.05, one / 4), _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                for _ in range(50):  # the interrupt lands in one of these runs
                    be.run(g, plan)
        finally:
            timer.cancel()
            timer.join()
        out = be.execute(g, plan, g.source.example_inputs)  # the backend still works
        assert np.allclose(out[0], _reference(g, g.source.example_inputs)[0], rtol=1e-4, atol=1e-5)
    assert not any(t.is_alive() for t in workers)


def test_close_joins_lanes_is_idempotent_and_a_forgotten_backend_stops_them(fan):
    be = OrtBackend(_machine(2))
    be.run(fan, uniform_plan(fan, be.machine, 1))
    workers = be.workers
    assert workers and all(t.is_alive() for t in workers)
    be.close()
    be.close()
    assert not any(t.is_alive() for t in workers)
    with pytest.raises(ExecutionError, match="closed"):
        be.run(fan, uniform_plan(fan, be.machine, 1))
    forgotten = OrtBackend(_machine(2))
    forgotten.run(fan, uniform_plan(fan, forgotten.machine, 1))
    threads = forgotten.workers
    del forgotten
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in threads)


def test_spinning_must_be_true_false_or_auto():
    with pytest.raises(ValueError, match="spinning"):
        OrtBackend(_machine(2), spinning="sometimes")


# ------------------------------------------------------------------ runtime model and profiles
def test_runtime_model_round_trips_and_is_registered(tmp_path):
    from opsched.backends.registry import spec
    from opsched.engine.contracts import RuntimeModel
    from opsched.engine.profiles import ProfileError

    assert spec("ort").runtime_model_class() is OrtRuntime
    rt = OrtRuntime(op_overhead_s=2e-6, handoff_s=3e-5, corun_c0=0.1, fitted_on=("x",))
    assert isinstance(rt, RuntimeModel) and rt.team_overhead_s == 0.0
    rt.save(tmp_path / "ort.json")
    assert OrtRuntime.load(tmp_path / "ort.json") == rt
    with pytest.raises(ProfileError, match="backend 'torch-cpu'"):
        OrtRuntime.from_dict({"backend": "torch-cpu"})
    with pytest.raises(ProfileError, match="handoff_s must be"):
        OrtRuntime.from_dict({"handoff_s": -1})


def test_profile_and_planning_model_for_ort(fan, tmp_path):
    from opsched.backends.ort_profiler import ort_cache_dir, profile_ort
    from opsched.backends.profiler import usable_cores
    from opsched.backends.runtime_fit import runtime_path
    from opsched.engine.models.runtime import PlanningModel
    from opsched.planning import planning_model

    machine = Machine.probe()
    levels = (1, 2) if usable_cores() >= 2 else (1,)
    prof = profile_ort(fan, machine, threads=levels, runs=3, warmup=1, rounds=1, interference=False,
                       cache_dir=ort_cache_dir(tmp_path))
    assert set(prof.ops) == {op.id for op in fan.ops} and prof.levels == levels
    assert all(min(p.samples[k]) > 0 for p in prof.ops.values() for k in levels)
    assert prof.settings["source"] == "onnxruntime profiler"
    again = profile_ort(fan, machine, threads=levels, interference=False, cache_dir=ort_cache_dir(tmp_path))
    assert again.to_dict() == prof.to_dict(), "reused from the cache"
    cpu = machine.cpu_only()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a profile taken under load is skipped with a LoadWarning
        model = planning_model(cpu, "ort", "auto", tmp_path)
        assert planning_model(cpu, "torch-cpu", "auto", tmp_path).name == "analytic", "kept apart from torch's"
        OrtRuntime(handoff_s=2e-5).save(runtime_path(cpu, "ort", tmp_path))
        model2 = planning_model(cpu, "ort", "auto", tmp_path)
    if model.name != "analytic":
        assert isinstance(model2, PlanningModel) and model2.runtime.backend == "ort"


def test_runtime_fit_recovers_a_hand_off_cost(fan):
    from opsched.backends.ort_fit import fit_ort_runtime, ort_plans
    from opsched.backends.runtime_fit import runtime_run, simulate
    from opsched.engine.models.analytic import AnalyticModel
    from opsched.engine.models.runtime import PlanningModel

    machine = _machine(2)
    perf = AnalyticModel()
    truth = OrtRuntime(op_overhead_s=2e-6, handoff_s=30e-6)
    plans = ort_plans(fan, machine, perf, n_plans=10)
    sims = simulate(fan, machine, PlanningModel(perf, truth), plans)
    measured = {"walls": {p: [t] for p, t in sims.items()}, "busy": {p: [t] for p, t in sims.items()},
                "others": {p: [0.0] for p in sims}}
    fit = fit_ort_runtime([runtime_run("fan", fan, plans, measured, machine, perf)], machine, perf)
    again = simulate(fan, machine, PlanningModel(perf, fit), plans)
    assert max(abs(again[p] / sims[p] - 1) for p in plans) < 0.02


# ------------------------------------------------------------------ apply
def test_apply_on_ort_checks_outputs_and_falls_back_on_other_shapes():
    from _nets import Branchy

    from opsched.scheduled import ScheduledOnnx, ScheduleFallbackWarning, apply

    torch.manual_seed(0)
    m, x = Branchy().eval(), torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleFallbackWarning)
        sm = apply("critical-path-first", m, x, backend="ort")
    assert isinstance(sm, ScheduledOnnx) and sm.scheduled and isinstance(sm, torch.nn.Module)
    out, ref = sm(x), m(x)
    assert isinstance(out, tuple) and all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(out, ref))
    x2 = torch.randn(1, 3, 16, 16)
    with pytest.warns(ScheduleFallbackWarning, match="differ from the planned"):
        out2 = sm(x2)
    assert all(torch.equal(a, b) for a, b in zip(out2, m(x2))), "the module itself ran"


def test_apply_an_onnx_file_and_the_cli(tmp_path):
    from typer.testing import CliRunner

    import opsched.commands.apply  # noqa: F401
    from opsched.cli import app
    from opsched.scheduled import apply

    path = tmp_path / "fan.onnx"
    path.write_bytes(_fan())
    sm = apply("critical-path-first", str(path))
    assert sm.scheduled and sm.backend.name == "ort"
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    assert np.allclose(sm(x)[0], sm.eager(x)[0], rtol=1e-4, atol=1e-5)
    res = CliRunner().invoke(app, ["apply", "--model", str(path), "--policy", "critical-path-first", "--repeats",
                                   "2", "--warmup", "0", "--out", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["backend"] == "ort" and data["reference"] == "ort-sequential"
    assert [r["config"] for r in data["rows"]][0] == "ort-sequential"
    assert all(r["outputs_equal_eager"] for r in data["rows"])
    res = CliRunner().invoke(app, ["apply", "--model", str(path), "--backend", "torch-cpu"])
    assert res.exit_code != 0 and "an ONNX model; use ort" in str(res.exception)


def test_a_weight_read_by_several_segments_is_shared_and_outputs_still_match():
    """Two chains reading one weight run on two lanes: their sessions get the graph's one
    copy of it (not pre-packed), and the outputs equal ONNX Runtime's sequential run."""
    rng = np.random.default_rng(3)
    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 64], (rng.standard_normal((64, 64)) / 8).ravel())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a1"], name="a1"), helper.make_node("Relu", ["a1"], ["a2"], name="a2"),
             helper.make_node("MatMul", ["x", "w"], ["b1"], name="b1"), helper.make_node("Tanh", ["b1"], ["b2"], name="b2"),
             helper.make_node("Add", ["a2", "b2"], ["y"], name="add")]
    g = from_onnx(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])], [w]),
                  name="shared-weight", opt_level="disable")
    machine = _machine(2)
    with OrtBackend(machine) as be:
        plan = uniform_plan(g, machine, 1)
        prog = be.compile(g, plan)
        lanes_with_w = {s.lane for s in prog.lowering.segments
                        if any(g.ops[i].id in ("a1", "b1") for i in s.ops)}
        assert len(lanes_with_w) == 2, "the two MatMuls co-run"
        assert "w" in g.source.__dict__.get("_shared_weights", {}), "one copy of w for both sessions"
        x = rng.standard_normal((8, 64)).astype(np.float32)
        assert np.allclose(be.execute(g, plan, (x,))[0], _reference(g, (x,))[0], rtol=1e-4, atol=1e-5)


class _TimedBackend:
    """A backend whose ``time_plan`` reports fixed seconds per plan policy (the
    measured choice reads it instead of the wall clock)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.calls: list[str] = []

    def time_plan(self, graph, plan, repeats, warmup, inputs):
        self.calls.append(plan.policy)
        return [self.seconds.get(plan.policy, 1.0)] * repeats


@pytest.mark.parametrize("faster", ["ort-single", "lanes"])
def test_measured_choice_keeps_the_faster_of_the_plan_and_one_session(faster: str) -> None:
    """The ort adapter offers the lowered plan and ONNX Runtime's one session, and the
    pipeline's measured choice (opsched.measured) times both and keeps the faster."""
    from opsched.adapters.onnx import OnnxAdapter
    from opsched.engine.models.analytic import AnalyticModel
    from opsched.measured import choose_measured

    m = _machine(2)
    graph = from_onnx(_fan(2, 3), name="fan")
    lanes = uniform_plan(graph, m, 1, policy="lanes")
    be = _TimedBackend({"ort-single": 0.002 if faster == "ort-single" else 0.004,
                        "lanes": 0.003})
    adapter = OnnxAdapter(_fan(2, 3), (), "ort")
    # a model that predicts the lowered plan far faster keeps it as the model's choice
    fast_model = PlanningModel(AnalyticModel(), OrtRuntime())
    chosen, found = adapter.choose(graph, lanes, None, m, fast_model, None)
    if chosen.policy == "ort-single":  # this model prefers one session: the candidates are nothing to time
        assert found is None
        found = {"model": (lanes, 0.001), "ort-single": (single_session_plan(graph, m), 0.002)}
    else:
        assert set(found) == {"model", "ort-single"}
    out = choose_measured(be, graph, found, graph.source.example_inputs, top=3, always=adapter.always_time)
    assert out.policy == faster
    assert set(out.meta["measured"]) == {"model", "ort-single"}
    assert set(be.calls) == {"lanes", "ort-single"}
    # the one session chosen by the model already: nothing to time
    single = single_session_plan(graph, m)
    assert adapter.choose(graph, single, None, m, fast_model, None) == (single, None)
