"""The scheduler interface and the heuristic baselines: valid plans everywhere,
and each baseline doing what its source says."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.backends.sim import SimBackend
from opsched.errors import PolicyError
from opsched.machine import PRESETS, Machine
from opsched.plan import Plan
from opsched.policies import (
    BASELINE,
    CONTROL,
    HINT,
    TEACHER,
    expand_names,
    get_policy,
    heuristic_names,
    names,
)
from opsched.policies.base import window_after
from opsched.policies.maestro import FEATURES, Maestro, MaestroSVM, fit_svm, maestro_features
from opsched.policies.registry import entries
from opsched.policies.search import OptunaSearch
from opsched.synthetic import FAMILIES, generate

MACHINES = {**PRESETS, "local": Machine.probe()}


def check_trace(graph, plan, machine, trace) -> None:
    """Every op ran once, after its inputs and its ``after`` ops, and no device
    ever ran more threads than it has slots."""
    ev = trace.by_op()
    assert set(ev) == {op.id for op in graph.ops}
    eps = 1e-12
    for e in graph.edges:
        assert ev[e.dst].start >= ev[e.src].end - eps, (e.src, e.dst)
    for op in graph.ops:
        for dep in plan[op.id].after:
            assert ev[op.id].start >= ev[dep].end - eps, (dep, op.id)
    for dev in machine.devices:
        mine = [x for x in trace.events if x.device == dev.id]
        for x in mine:
            busy = sum(y.threads for y in mine if y.start <= x.start < y.end)
            assert busy <= dev.cores, (dev.id, x.op, busy)


def max_concurrency(trace, device: str) -> int:
    evs = [e for e in trace.events if e.device == device]
    return max((sum(1 for y in evs if y.start <= x.start < y.end) for x in evs), default=0)


# ------------------------------------------------------------------ validity
@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("policy", heuristic_names())
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FAMILIES)), n_ops=st.integers(2, 60), seed=st.integers(0, 10_000))
def test_every_heuristic_plans_validly_on_random_graphs(policy, machine, family, n_ops, seed):
    m = MACHINES[machine]
    g = generate(family, n_ops, seed)
    plan = get_policy(policy).plan(g, m)
    assert isinstance(plan, Plan) and plan.policy == policy
    plan.validate(g, m)
    check_trace(g, plan, m, SimBackend(m).run(g, plan))


@functools.cache
def zoo_graph(name: str):
    from opsched.specs import load_graph

    return load_graph(f"zoo:{name}", batch=1, width=0.25)


def _zoo_names() -> list[str]:
    from opsched.zoo import ZOO

    return sorted(ZOO)


@pytest.mark.parametrize("machine", ["knl-68", "dgx1-4v100"])
@pytest.mark.parametrize("name", _zoo_names())
def test_every_heuristic_plans_validly_on_the_zoo(name, machine):
    """Every heuristic on every zoo model, on a manycore CPU and a multi-GPU box
    (the property test above covers every preset)."""
    g, m = zoo_graph(name), PRESETS[machine]
    for policy in heuristic_names():
        plan = get_policy(policy).plan(g, m)
        plan.validate(g, m)
        assert len(plan) == len(g.ops)


# ------------------------------------------------------------------ registry
def test_registry_names_and_all():
    assert expand_names("all") == [*heuristic_names(), "learned"]
    assert expand_names("all,search") == [*heuristic_names(), "learned", "search"]
    assert expand_names("cpf, heft,cpf") == ["critical-path-first", "heft"]
    assert heuristic_names()[0] == "sequential"  # the reference comes first
    assert set(heuristic_names()) < set(names())
    for name in names():
        assert get_policy(name).name == name
    assert get_policy("graphi").name == "critical-path-first"


def test_registry_roles_drive_every_consumer():
    """One registry: compare's 'all', the training run's baselines and teachers, the hint set
    of the learned policy and the bench all read the roles."""
    from opsched.agents.config import TrainConfig
    from opsched.agents.train import teachers
    from opsched.policies.hints import hint_names

    by_name = {e.name: e for e in entries()}
    assert "random" in heuristic_names() and CONTROL in by_name["random"].roles
    assert "random" not in names(BASELINE) and "random" not in names(TEACHER) and "random" not in names(HINT)
    assert "search" in names() and not by_name["search"].roles and "search" not in heuristic_names()
    assert TrainConfig().baselines == list(names(BASELINE))
    assert teachers() == names(TEACHER)
    assert hint_names() == names(HINT)
    assert get_policy("learned").hints == hint_names()  # the shipped policy was exported with this set


def test_a_new_heuristic_is_one_module(tmp_path, monkeypatch):
    """A module in policies/ with the decorator is found by name and in its roles, nothing else edited."""
    import opsched.policies as pkg
    from opsched.policies import registry

    mod = tmp_path / "dummy_heuristic_for_test.py"
    mod.write_text(
        "from opsched.policies.base import Policy, build_plan\n"
        "from opsched.policies.heuristics import Sequential\n"
        "from opsched.policies.registry import BASELINE, register\n\n\n"
        "@register('dummy-test', roles=(BASELINE,), order=999)\n"
        "class Dummy(Sequential):\n"
        "    name = 'dummy-test'\n")
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setitem(__import__("sys").modules, "opsched.policies.dummy_heuristic_for_test", None)
    __import__("sys").modules.pop("opsched.policies.dummy_heuristic_for_test")
    try:
        assert "dummy-test" in names(BASELINE) and heuristic_names()[-1] == "dummy-test"
        assert get_policy("dummy-test").name == "dummy-test"
        assert "dummy-test" in expand_names("all")
    finally:
        registry._ENTRIES.pop("dummy-test", None)


def test_registry_errors_are_clear():
    with pytest.raises(PolicyError, match="unknown policy 'nope'.*sequential"):
        get_policy("nope")
    with pytest.raises(PolicyError, match="no policy"):
        expand_names(" , ")


# ------------------------------------------------------------------ baselines
@pytest.mark.parametrize("machine", ["knl-68", "dgx1-4v100"])
def test_sequential_runs_one_op_at_a_time_in_topological_order(machine):
    m = PRESETS[machine]
    g = generate("erdos_renyi", 40, 1)
    trace = SimBackend(m).run(g, get_policy("sequential").plan(g, m))
    events = sorted(trace.events, key=lambda e: e.start)
    for a, b in zip(events, events[1:]):
        assert b.start >= a.end - 1e-12
    assert [e.op for e in events] == g.topological_order()
    dev = "gpu:0" if m.gpus else "cpu"
    assert {(e.device, e.threads) for e in events} == {(dev, 1 if m.gpus else m.cpu.cores)}


def test_tf_settings_meta_and_concurrency():
    xeon = PRESETS["xeon-8180-2s"]  # 2 sockets x 28 cores, SMT 2
    g = generate("layered", 50, 4, mean_width=6.0)
    rec = get_policy("tf-recommended").plan(g, xeon)
    assert (rec.meta["intra_op"], rec.meta["inter_op"]) == (28, 2)
    assert max(a.threads for a in rec.assignments.values()) <= 28
    assert max_concurrency(SimBackend(xeon).run(g, rec), "cpu") <= 2
    default = get_policy("tf-default").plan(g, xeon)
    assert (default.meta["intra_op"], default.meta["inter_op"]) == (112, 112)
    # library kernels take the whole pool; small Eigen ops fewer threads
    threads = {g.op(k).kind: a.threads for k, a in default.assignments.items()}
    if "conv" in threads:
        assert threads["conv"] == 56
    knl = PRESETS["knl-68"]
    assert get_policy("tf-recommended").plan(g, knl).meta == {"intra_op": 68, "inter_op": 1, "device": "cpu"}


def test_critical_path_first_profiles_and_dispatches_by_upward_rank():
    m = PRESETS["knl-68"]
    g = generate("erdos_renyi", 50, 2)
    plan = get_policy("critical-path-first").plan(g, m)
    profile, skipped = plan.meta["profile"], plan.meta["skipped"]
    assert len(profile) + len(skipped) == len(m.cpu.thread_levels()) and not set(profile) & set(skipped)
    assert skipped, "on a 50-op graph on knl-68 the bounds leave splits out"
    e, t = plan.meta["executors"], plan.meta["threads"]
    assert profile[f"cpu {e}x{t}"] == min(profile.values())
    assert min(skipped.values()) > min(profile.values())
    assert e == m.cpu.cores // t and {a.threads for a in plan.assignments.values()} == {t}
    for edge in g.edges:  # upward rank: a producer always outranks its consumers
        assert plan[edge.src].priority > plan[edge.dst].priority
    trace = SimBackend(m).run(g, plan)
    assert trace.makespan == pytest.approx(min(profile.values()))
    assert max_concurrency(trace, "cpu") <= e


def _exhaustive_cpf(g, m, model):
    """Graphi's profiling without bounds: every split simulated, the first fastest kept."""
    from opsched.engine.sim import Simulator

    cpf = get_policy("critical-path-first")
    table = model.time_table(g, m)
    best = None
    for device, _executors, threads in cpf.candidate_configs(m):
        plan = cpf.plan_for(g, m, table, device, threads)
        span = Simulator(m, model=model).makespan(g, plan)
        if best is None or span < best[0]:
            best = (span, plan)
    return best


def _runtime_model():
    from opsched.engine.models.analytic import AnalyticModel
    from opsched.engine.models.runtime import PlanningModel, TorchCPURuntime

    return PlanningModel(AnalyticModel(), TorchCPURuntime(op_overhead_s=2e-5, thread_switch_s=3e-5,
                                                           team_overhead_s=1e-4, handoff_s=2e-5, spin_s=2e-4,
                                                           host_s=1e-5, corun_c0=0.05))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(FAMILIES)), n=st.integers(2, 60), seed=st.integers(0, 10_000),
       machine=st.sampled_from(sorted(PRESETS)), runtime=st.booleans())
def test_critical_path_first_skipping_splits_by_their_bound_picks_what_profiling_every_split_picks(
        family, n, seed, machine, runtime):
    """The bound (critical path, work over executors) never exceeds a split's simulated makespan,
    and skipping the splits it rules out changes nothing: the same plan, the same makespan."""
    from opsched.engine.sim import Simulator
    from opsched.policies.base import resolve_model

    g, m = generate(family, n, seed), PRESETS[machine]
    model = _runtime_model() if runtime else resolve_model(None)
    plan = get_policy("critical-path-first").plan(g, m, model)
    span, want = _exhaustive_cpf(g, m, model)
    assert plan.assignments == want.assignments
    assert Simulator(m, model=model).makespan(g, plan) == pytest.approx(span, rel=1e-12)
    for key, bound in plan.meta["skipped"].items():
        dev, split = key.split(" ")
        t = int(split.split("x")[1])
        skipped = get_policy("critical-path-first").plan_for(g, m, model.time_table(g, m), dev, t)
        assert Simulator(m, model=model).makespan(g, skipped) >= bound * (1 - 1e-12)


def test_window_after_bounds_concurrency():
    m = PRESETS["knl-68"]
    g = generate("layered", 40, 5, mean_width=8.0)
    order = g.topo_index
    after = window_after(g, order, 3)
    from opsched.plan import Assignment

    plan = Plan.build(g, m, {op.id: Assignment("cpu", 1, 0.0, after[i]) for i, op in enumerate(g.ops)})
    assert max_concurrency(SimBackend(m).run(g, plan), "cpu") <= 3


def test_random_policy_is_seeded():
    m = PRESETS["dgx1-4v100"]
    g = generate("layered", 30, 0)
    a = get_policy("random", seed=3).plan(g, m)
    assert a == get_policy("random", seed=3).plan(g, m)
    assert a != get_policy("random", seed=4).plan(g, m)


# ------------------------------------------------------------------ maestro
def test_maestro_svm_matches_sklearn_decision_function():
    from sklearn.svm import SVC

    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, len(FEATURES))) * [1, 2, 3, 1, 0.5, 4] + [2, 0, 1, 0, 3, 1]
    y = X[:, 0] + X[:, 1] > 2.0
    svm = fit_svm(X, y, C=3.0)
    mean, scale = X.mean(axis=0), X.std(axis=0)
    ref = SVC(kernel="rbf", C=3.0, gamma="scale", class_weight="balanced").fit((X - mean) / scale, y)
    Xt = rng.normal(size=(30, len(FEATURES))) * 2
    ours = np.array([svm.decision(x) for x in Xt])
    assert np.allclose(ours, ref.decision_function((Xt - mean) / scale), atol=1e-8)


def test_maestro_shipped_classifier_round_trips(tmp_path):
    svm = MaestroSVM.load()
    svm.save(tmp_path / "svm.json")
    again = MaestroSVM.load(tmp_path / "svm.json")
    x = np.arange(len(FEATURES), dtype=float)
    assert again.decision(x) == svm.decision(x)


def test_maestro_classifier_separates_chains_from_wide_graphs():
    """The shipped SVM on graphs it was not trained on (seed 11): a near-chain
    is kept on one GPU, a wide layered graph is spread."""
    m = PRESETS["dgx1-4v100"]
    svm = MaestroSVM.load()
    chain = generate("layered", 40, 11, mean_width=1.0)
    wide = generate("layered", 60, 11, mean_width=8.0)
    assert not svm.multi_gpu(maestro_features(chain, m))
    assert svm.multi_gpu(maestro_features(wide, m))
    plan = Maestro().plan(wide, m)
    assert plan.meta["multi_gpu"] and len(plan.meta["devices_used"]) >= 2
    assert Maestro().plan(chain, m).meta["devices_used"] == ["gpu:0"]


@pytest.mark.parametrize("text, match", [
    (None, "no such Maestro classifier file"),
    ("{not json", "not valid JSON"),
    ('{"format": "something else"}', "not a Maestro classifier"),
    ('{"format": "opsched.maestro-svm", "version": 99}', "version 99"),
])
def test_maestro_bad_classifier_files(tmp_path, text, match):
    path = tmp_path / "svm.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PolicyError, match=match) as err:
        MaestroSVM.load(path)
    assert str(path) in str(err.value)


def test_maestro_classifier_with_wrong_shapes(tmp_path):
    data = MaestroSVM.load().to_dict()
    data["dual_coef"] = data["dual_coef"][:-1]
    path = tmp_path / "svm.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match="inconsistent shapes"):
        MaestroSVM.load(path)


def test_maestro_degrades_to_one_device_without_gpus():
    m = PRESETS["knl-68"]
    g = generate("layered", 40, 1, mean_width=6.0)
    plan = Maestro().plan(g, m)
    assert plan.meta["devices_used"] == ["cpu"] and not plan.meta["multi_gpu"]
    trace = SimBackend(m).run(g, plan)
    assert max_concurrency(trace, "cpu") == 1


def test_maestro_groups_are_parallel_layers():
    from opsched.policies.maestro import group_layers, scheduling_order

    g = generate("layered", 50, 2, mean_width=5.0)
    order = scheduling_order(g, np.ones(len(g.ops)))
    groups = group_layers(g, order)
    assert [i for grp in groups for i in grp] == order
    for grp in groups:
        members = set(grp)
        assert not any(p in members for i in grp for p in g.pred_index[i])


# ------------------------------------------------------------------ search
def test_search_improves_on_its_warm_start_and_is_seeded():
    m = PRESETS["dgx1-4v100"]
    g = generate("erdos_renyi", 25, 3)
    plan = OptunaSearch(n_trials=40, seed=1).plan(g, m)
    plan.validate(g, m)
    assert plan.meta["n_trials"] == 40
    assert plan.meta["predicted_makespan"] <= plan.meta["first_makespan"]
    assert SimBackend(m).run(g, plan).makespan == pytest.approx(plan.meta["predicted_makespan"])
    assert OptunaSearch(n_trials=40, seed=1).plan(g, m) == plan


def test_search_resumes_from_storage(tmp_path):
    m = PRESETS["knl-68"]
    g = generate("layered", 4, 0)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    OptunaSearch(n_trials=3, storage=url).plan(g, m)
    second = OptunaSearch(n_trials=3, storage=url).plan(g, m)
    assert second.meta["n_trials"] == 6


def test_search_rejects_bad_settings():
    with pytest.raises(ValueError, match="n_trials"):
        OptunaSearch(n_trials=0)
    with pytest.raises(ValueError, match="sampler"):
        OptunaSearch(sampler="magic")


@pytest.mark.parametrize("machine", ["knl-68", "dgx1-4v100"])
@pytest.mark.parametrize("runtime", [False, True])
def test_a_makespan_a_heuristic_records_is_the_simulators(machine, runtime):
    """heuristic_plans and the exported scheduler take a heuristic's own ``model_makespan``
    instead of simulating its plan again: it must be the simulator's value, bit for bit."""
    from opsched.engine.sim import Simulator
    from opsched.policies import BASELINE, names
    from opsched.policies.base import MODEL_MAKESPAN, resolve_model
    from opsched.policies.hints import clear_cache, heuristic_plans

    g, m = generate("layered", 60, 4), PRESETS[machine]
    model = _runtime_model() if runtime else resolve_model(None)
    recorded = 0
    for name in names(BASELINE):
        plan = get_policy(name).plan(g, m, model)
        if MODEL_MAKESPAN in plan.meta:
            recorded += 1
            assert plan.meta[MODEL_MAKESPAN] == Simulator(m, model).makespan(g, plan), name
    assert recorded >= 4  # critical-path-first, cpa, bicpa, lp-rounding
    clear_cache()
    for name, (plan, span) in heuristic_plans(g, m, model).items():
        assert span == Simulator(m, model).makespan(g, plan), name
