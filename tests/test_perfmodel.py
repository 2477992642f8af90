"""Performance models: the analytic roofline and the model fitted on profiles."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.engine.models.analytic import AnalyticModel
from opsched.engine.models.fitted import Amdahl, FittedModel, KindShape, fit_amdahl, fit_kind_shape
from opsched.engine.models.interference import InterferenceFit, PairRecord, fit_interference
from opsched.engine.profiles import OpProfile, Profile, ProfileError
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import PRESETS, Device, Machine
from opsched.synthetic import generate

CPU = Device(id="cpu", kind="cpu", cores=16, gflops=50.0, mem_bandwidth_gbs=40.0, memory_gb=64.0, name="testcpu")
MACHINE = Machine(name="test16", devices=(CPU,))
LEVELS = CPU.thread_levels()  # 1, 2, 4, 8, 16


def _truth(op: Op) -> Amdahl:
    """A made-up but plausible ground truth: time grows with FLOPs and bytes, 10% serial."""
    t1 = 2e-6 + op.flops / 20e9 + op.bytes_total / 10e9
    return Amdahl(0.1 * t1, 0.9 * t1, 1.5e-6)


def _graph(n: int = 24, seed: int = 0, prefix: str = "op") -> OpGraph:
    rng = np.random.default_rng(seed)
    ops = []
    for i in range(n):
        kind = ("conv", "elementwise", "matmul")[i % 3]
        flops = 0.0 if kind == "elementwise" else float(rng.uniform(1e6, 1e8))
        ops.append(Op(f"{prefix}{i}", f"{prefix}{i}", kind, flops, float(rng.uniform(1e4, 1e6)), 1e4, 0.0,
                      (1, int(rng.integers(4, 64)))))
    edges = [Edge(ops[i].id, ops[i + 1].id, 1e4) for i in range(n - 1)]
    return OpGraph(tuple(ops), tuple(edges), name=f"g{seed}")


def _profile(graph: OpGraph, levels=LEVELS, noise: float = 0.0, seed: int = 0, device: Device = CPU,
             others: float = 0.0, interference=None) -> Profile:
    rng = np.random.default_rng(seed)
    ops = {}
    for op in graph.ops:
        truth = _truth(op)
        samples = {k: tuple(truth(k) * (1 + noise * rng.standard_normal(5))) for k in levels}
        ops[op.id] = OpProfile(op.id, op.kind, op.flops, op.bytes_total, op.shape, samples, others)
    mach = Machine(name="m", devices=(device,))
    return Profile(graph.fingerprint(), graph.name, mach.fingerprint(), mach.name, asdict(device), tuple(levels),
                   ops, interference)


# ------------------------------------------------------------------ Amdahl
def test_fit_amdahl_recovers_known_parameters():
    truth = Amdahl(4e-5, 3.6e-4, 2e-6)
    fit = fit_amdahl({k: truth(k) for k in LEVELS})
    assert (fit.a, fit.b, fit.c) == pytest.approx((truth.a, truth.b, truth.c), rel=1e-3)


def test_fit_amdahl_with_noise_predicts_unmeasured_levels():
    truth = Amdahl(4e-5, 3.6e-4, 2e-6)
    rng = np.random.default_rng(1)
    fit = fit_amdahl({k: truth(k) * (1 + 0.01 * rng.standard_normal()) for k in LEVELS})
    for k in (3, 6, 12):
        assert fit(k) == pytest.approx(truth(k), rel=0.05)
    assert min(fit.a, fit.b, fit.c) >= 0


def test_kind_shape_is_identified_from_two_levels_across_op_sizes():
    sigma, c = 0.2, 3e-6
    ops = []
    for t1 in np.geomspace(1e-5, 1e-2, 12):
        ops.append({1: t1, 2: t1 * (sigma + (1 - sigma) / 2) + c})
    shape = fit_kind_shape(ops)
    assert shape.serial == pytest.approx(sigma, abs=1e-3)
    assert shape.overhead_s == pytest.approx(c, rel=1e-2)
    # with the kind's shape as prior, one op's two points pin down its curve
    prior = shape.prior_for(ops[3])
    fit = fit_amdahl(ops[3], prior)
    assert fit(2) == pytest.approx(ops[3][2], rel=1e-3)


def test_fitted_model_recovers_amdahl_from_profile():
    g = _graph()
    model = FittedModel(_profile(g, noise=0.005), use_measured=False)
    for op in g.ops:
        for k in (3, 5, 12, 16):
            assert model.op_time(op, CPU, k) == pytest.approx(_truth(op)(k), rel=0.05)


def test_measured_points_are_returned_where_measured():
    g = _graph()
    prof = _profile(g, noise=0.02)
    model = FittedModel(prof)
    op = g.ops[4]
    assert model.op_time(op, CPU, 4) == pytest.approx(prof.ops[op.id].median[4])
    assert model.source(op, CPU, 4) == "measured" and model.source(op, CPU, 3) == "amdahl"


def test_two_level_profile_predicts_left_out_level_through_the_kind_shape():
    g = _graph(36)
    prof = _profile(g, levels=(1, 2))
    ops = dict(prof.ops)
    held = g.ops[5]
    ops[held.id] = OpProfile(held.id, held.kind, held.flops, held.bytes_total, held.shape,
                             {1: prof.ops[held.id].samples[1]})
    model = FittedModel(Profile(**{**prof.__dict__, "ops": ops}))
    assert model.op_time(held, CPU, 2) == pytest.approx(_truth(held)(2), rel=0.02)


def test_contended_multithread_measurements_are_not_trusted():
    g = _graph(30)
    clean = _profile(g, levels=(1, 2))
    ops = dict(clean.ops)
    bad = g.ops[7]
    ops[bad.id] = OpProfile(bad.id, bad.kind, bad.flops, bad.bytes_total, bad.shape,
                            {1: clean.ops[bad.id].samples[1], 2: (0.03,) * 5}, others_cores=1.5)
    model = FittedModel(Profile(**{**clean.__dict__, "ops": ops}))
    assert model.op_time(bad, CPU, 2) == pytest.approx(_truth(bad)(2), rel=0.05)
    assert model.op_time(bad, CPU, 1) == pytest.approx(_truth(bad)(1))


# ------------------------------------------------------------- coverage
def test_predictions_for_unprofiled_ops_and_every_preset():
    model = FittedModel([_profile(_graph(60, seed=s, prefix=f"s{s}_"), seed=s) for s in range(2)])
    other = generate("layered", 80, 3)  # never profiled
    for mach in [MACHINE, *PRESETS.values()]:
        table = model.time_table(other, mach)
        base = AnalyticModel().time_table(other, mach)
        assert table.times.shape == base.times.shape
        assert np.array_equal(np.isfinite(table.times), np.isfinite(base.times))
        finite = table.times[np.isfinite(table.times)]
        assert finite.size and np.all(finite > 0)
    unseen = _graph(9, seed=7, prefix="new")
    for op in unseen.ops:
        assert model.source(op, CPU, 2) == "neighbours"
        # the neighbour correction tracks the time law: within 25% of the truth on unseen sizes
        assert model.op_time(op, CPU, 2) == pytest.approx(_truth(op)(2), rel=0.25)
    gpu = PRESETS["dgx1-4v100"].device("gpu:0")
    assert model.source(unseen.ops[0], gpu, 1) == "analytic"
    assert model.source(unseen.ops[0], PRESETS["knl-68"].cpu, 4) == "analytic-scaled"


def test_ops_match_by_id_in_their_graph_else_by_signature():
    g = _graph(12)
    prof = _profile(g, noise=0.02)
    model = FittedModel(prof)
    # the same graph: each op its own measurement
    table = model.time_table(g, MACHINE)
    for i, op in enumerate(g.ops):
        assert table.time(i, 0, 2) == pytest.approx(prof.ops[op.id].median[2])
    # another graph holding a renamed copy of an op: matched by signature
    twin = Op("elsewhere", "x", g.ops[3].kind, g.ops[3].flops, g.ops[3].bytes_read, g.ops[3].bytes_written,
              g.ops[3].param_bytes, g.ops[3].shape)
    assert model.op_time(twin, CPU, 2) == pytest.approx(prof.ops[g.ops[3].id].median[2])
    assert model.source(twin, CPU, 2) == "measured"


def test_machine_factor_scales_the_analytic_model_on_other_cpus():
    g = _graph(30)
    model = FittedModel(_profile(g))
    knl = PRESETS["knl-68"].cpu
    op = g.ops[0]
    assert model.op_time(op, knl, 4) == pytest.approx(
        AnalyticModel().op_time(op, knl, 4) * model.machine_factor[op.kind])


def test_profiles_of_different_machines_cannot_be_mixed():
    other = Device(id="cpu", kind="cpu", cores=8, gflops=50.0, mem_bandwidth_gbs=40.0, memory_gb=64.0, name="x")
    with pytest.raises(ProfileError, match="different machines"):
        FittedModel([_profile(_graph()), _profile(_graph(seed=2), levels=(1, 2, 4, 8), device=other)])
    with pytest.raises(ProfileError, match="at least one profile"):
        FittedModel([])


def test_the_planning_model_is_chosen_in_one_place(tmp_path):
    """Analytic without profiles; fitted with them; plus the runtime model once
    `opsched profile` stored one; a profile measured under load is skipped, loudly."""
    from opsched.backends.runtime_fit import runtime_path
    from opsched.engine.models.runtime import PlanningModel, TorchCPURuntime
    from opsched.errors import OpschedError
    from opsched.planning import LoadWarning, planning_model

    assert isinstance(planning_model(MACHINE, "torch-cpu", "auto", tmp_path), AnalyticModel)
    with pytest.raises(OpschedError, match="no usable profiles"):
        planning_model(MACHINE, "torch-cpu", "fitted", tmp_path)
    _profile(_graph()).save(tmp_path / "a.json")
    assert isinstance(planning_model(MACHINE, "torch-cpu", "auto", tmp_path), FittedModel)
    assert isinstance(planning_model(MACHINE, "sim", "auto", tmp_path), AnalyticModel)  # presets stay analytic
    TorchCPURuntime(op_overhead_s=5e-6, handoff_s=2e-5).save(runtime_path(MACHINE, "torch-cpu", tmp_path))
    model = planning_model(MACHINE, "torch-cpu", "auto", tmp_path)
    assert isinstance(model, PlanningModel) and model.runtime.handoff_s == 2e-5
    assert isinstance(planning_model(MACHINE, "tf", "auto", tmp_path), FittedModel)  # no runtime model for tf
    _profile(_graph(seed=3, prefix="x"), others=1.5).save(tmp_path / "b.json")
    with pytest.warns(LoadWarning, match="other processes used 1.50 cores"):
        model = planning_model(MACHINE, "torch-cpu", "fitted", tmp_path)
    assert len(model.perf.profiles) == 1


def test_transfer_time_is_bytes_over_bandwidth_plus_latency():
    mach = PRESETS["dgx1-4v100"]
    model = FittedModel(_profile(_graph()))
    link = mach.link("gpu:0", "gpu:1")
    expect = 1e8 / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6
    assert model.transfer_time(1e8, "gpu:0", "gpu:1", mach) == pytest.approx(expect)
    assert model.transfer_time(1e8, "gpu:0", "gpu:0", mach) == 0.0


# --------------------------------------------------------- interference
def _records(fit: InterferenceFit, demands) -> list[PairRecord]:
    out = []
    for da, db in demands:
        sa, sb = fit.slowdown([da, db])
        out.append(PairRecord("a", "b", "x", 1e-3, 1e-3, 1e-3 * sa, 1e-3 * sb, da, db))
    return out


def test_interference_fit_recovers_known_term():
    truth = InterferenceFit(bandwidth_gbs=20.0, c0=0.03, gamma=0.8)
    demands = [(d1, d2) for d1 in (1, 5, 12, 20, 30) for d2 in (2, 10, 25)]
    fit = fit_interference(_records(truth, demands), bandwidth_gbs=20.0)
    assert fit.c0 == pytest.approx(0.03, abs=0.01)
    assert fit.gamma == pytest.approx(0.8, rel=0.15)
    assert fit.rmse < 0.01


def test_fitted_model_uses_the_profiled_interference():
    truth = InterferenceFit(bandwidth_gbs=20.0, c0=0.05, gamma=1.0)
    pairs = [r.__dict__ for r in _records(truth, [(d, e) for d in (1, 10, 25) for e in (5, 15, 30)])]
    prof = _profile(_graph(), interference={"pairs": pairs, "bandwidth_gbs": {"one_stream": 15.0,
                                                                              "all_streams": 20.0}})
    model = FittedModel(prof)
    assert model.slowdown(CPU, np.array([10.0, 25.0])) == pytest.approx(truth.slowdown([10.0, 25.0]), rel=0.05)
    knl = PRESETS["knl-68"].cpu  # elsewhere: the analytic term
    d = np.array([300.0, 300.0])
    assert np.allclose(model.slowdown(knl, d), AnalyticModel().slowdown(knl, d))


MODELS = {
    "analytic": AnalyticModel(),
    "fitted": FittedModel(_profile(_graph(), interference={"pairs": [r.__dict__ for r in _records(
        InterferenceFit(8.0, 0.02, 1.3), [(1, 2), (6, 9), (12, 3), (20, 20)])], "bandwidth_gbs": {"x": 8.0}})),
}


@settings(max_examples=60, deadline=None)
@given(model_name=st.sampled_from(sorted(MODELS)),
       demands=st.lists(st.floats(0, 500, allow_nan=False), min_size=1, max_size=6),
       extra=st.floats(0, 200, allow_nan=False), who=st.integers(0, 5))
def test_slowdown_is_at_least_one_and_monotone_in_co_runner_demand(model_name, demands, extra, who):
    model = MODELS[model_name]
    d = np.array(demands)
    base = model.slowdown(CPU, d)
    assert base.shape == d.shape and np.all(base >= 1.0)
    if len(d) < 2:
        return
    j = who % len(d)  # raise one co-runner's demand: nobody else gets faster
    more = d.copy()
    more[j] += extra
    after = model.slowdown(CPU, more)
    others = np.arange(len(d)) != j
    assert np.all(after[others] >= base[others] - 1e-12)


def test_mem_demand_is_bytes_over_time():
    g = _graph()
    model = FittedModel(_profile(g))
    op = g.ops[2]
    assert model.mem_demand(op, CPU, 2) == pytest.approx(op.bytes_total / model.op_time(op, CPU, 2) / 1e9)


def test_kind_shape_prior_passes_through_a_single_point():
    shape = KindShape(serial=0.3, overhead_s=2e-6)
    prior = shape.prior_for({2: 1e-3})
    assert prior(2) == pytest.approx(1e-3)
