"""The Gymnasium environment (issue 4): API checks, rewards, exact replay,
masks, coarsening, real mode, vectorised use, and a hypothesis property test."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from _reference import observe
from gymnasium.error import ResetNeeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opsched.backends.sim import SimBackend
from opsched.engine.coarsen import coarsen
from opsched.engine.layout import MAX_DEVICES, MAX_LEVELS, ActionLayout
from opsched.engine.sim import lower_bound, sequential_makespan
from opsched.envs import ENV_ID, REAL_ENV_ID
from opsched.envs.schedule_env import InvalidActionError, ScheduleEnv
from opsched.graph import Edge, Op, OpGraph
from opsched.machine import Device, Machine, get_machine
from opsched.plan import Plan

KINDS = ["conv", "matmul", "elementwise", "norm", "pool", "concat_split"]


def random_graph(n: int, seed: int, p_edge: float = 0.3) -> OpGraph:
    rng = np.random.default_rng(seed)
    ops = [Op(f"n{i}", f"n{i}", KINDS[int(rng.integers(len(KINDS)))],
              float(10 ** rng.uniform(4, 9)) if rng.random() < 0.8 else 0.0,
              float(10 ** rng.uniform(3, 7)), float(10 ** rng.uniform(3, 7))) for i in range(n)]
    edges = [Edge(f"n{j}", f"n{i}", float(10 ** rng.uniform(3, 7)))
             for i in range(n) for j in range(i) if rng.random() < p_edge]
    return OpGraph(tuple(ops), tuple(edges), name=f"rand{n}-{seed}")


def small_cpu(cores: int) -> Machine:
    return Machine(f"cpu{cores}", (Device("cpu", "cpu", cores, 40.0, 20.0, 8.0),))


def play(env: ScheduleEnv, rng: np.random.Generator, p_wait: float = 0.2, seed: int | None = None,
         options: dict | None = None, check_obs: bool = False):
    """Run one episode with random valid actions; returns (rewards, final info, steps)."""
    obs, _ = env.reset(seed=seed, options=options)
    rewards, steps = [], 0
    while True:
        if check_obs:
            assert env.observation_space.contains(obs)
            ref = observe(env.episode_data, env.episode.st)
            assert all(np.array_equal(obs[k], ref[k].reshape(-1)) for k in obs)
        mask = env.action_masks()
        valid = np.flatnonzero(mask)
        if mask[-1] and (len(valid) == 1 or rng.random() < p_wait):
            a = env.layout.wait
        else:
            starts = valid[valid != env.layout.wait]
            a = int(starts[rng.integers(len(starts))])
        obs, r, terminated, truncated, info = env.step(a)
        rewards.append(r)
        steps += 1
        assert not truncated
        if terminated:
            return rewards, info, steps


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return random_graph(24, 0)


# ------------------------------------------------------------ registration
def test_registered_ids_and_make(graph):
    import opsched.envs

    assert opsched.envs.ScheduleEnv is ScheduleEnv
    assert ENV_ID in gym.registry and REAL_ENV_ID in gym.registry
    assert gym.spec(REAL_ENV_ID).nondeterministic is True
    assert gym.spec(ENV_ID).nondeterministic is False
    env = gym.make(ENV_ID, graphs=[graph], machine="xeon-8180-2s")
    assert isinstance(env.unwrapped, ScheduleEnv)
    env.reset(seed=0)
    env.close()


def test_import_without_gymnasium_does_not_fail():
    code = ("import sys; sys.modules['gymnasium'] = None\n"
            "import opsched.envs as e\n"
            "assert e.REGISTERED is False and e.ActionLayout(4).n == 4 * 64 + 1\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------ API checkers
@pytest.mark.parametrize("checker", ["gymnasium", "sb3"])
@pytest.mark.parametrize("env_id", sorted(k for k in gym.registry if k.startswith("opsched/")))
def test_every_registered_id_passes_both_checkers_as_made_bare(env_id, checker):
    """``gym.make(id)`` with no arguments works for every registered id, and
    Gymnasium's and SB3's checkers pass without a single warning."""
    if checker == "gymnasium":
        from gymnasium.utils.env_checker import check_env
    else:
        from stable_baselines3.common.env_checker import check_env
    env = gym.make(env_id)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env.unwrapped)
    finally:
        env.close()


def test_gymnasium_check_env(graph):
    from gymnasium.utils.env_checker import check_env

    env = gym.make(ENV_ID, graphs=[graph], machine="dgx1-4v100", max_nodes=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning fails the test
        check_env(env.unwrapped)
    env.close()


def test_sb3_check_env(graph):
    from stable_baselines3.common.env_checker import check_env

    env = ScheduleEnv(graphs=[graph, random_graph(10, 1)], machine=["knl-68", "2x2080ti"], max_nodes=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning fails the test
        check_env(env)


# ----------------------------------------------------------------- rewards
@pytest.mark.parametrize("machine", ["xeon-8180-2s", "dgx1-4v100"])
def test_rewards_sign_and_sum(graph, machine):
    m = get_machine(machine)
    env = ScheduleEnv(graphs=graph, machine=m, max_nodes=32)
    for seed in range(3):
        rewards, info, steps = play(env, np.random.default_rng(seed), seed=seed)
        assert all(r <= 0.0 for r in rewards)
        assert any(r < 0.0 for r in rewards)
        assert info["reference"] == pytest.approx(sequential_makespan(graph, m), rel=1e-12)
        assert sum(rewards) == pytest.approx(-info["makespan"] / info["reference"], rel=1e-9)
        assert info["makespan"] == info["trace"].makespan
        assert steps <= 2 * len(graph.ops)


def test_sequential_decisions_return_minus_one(graph):
    """Every op alone with all cores, in topological order: the return is exactly -1."""
    m = get_machine("xeon-8180-2s")
    env = ScheduleEnv(graphs=graph, machine=m, max_nodes=32)
    env.reset(seed=0)
    total, terminated = 0.0, False
    top = len(m.cpu.thread_levels()) - 1
    while not terminated:
        ready = np.flatnonzero(env.action_masks()[:-1].reshape(32, MAX_DEVICES, MAX_LEVELS)[:, 0, top])
        _, r, terminated, _, info = env.step(env.layout.encode(int(ready[0]), 0, top))
        total += r
    assert total == pytest.approx(-1.0, rel=1e-9)


# ------------------------------------------------------------------ replay
@pytest.mark.parametrize("machine", ["xeon-8180-2s", "knl-68", "dgx1-4v100", "2x2080ti"])
def test_plan_replays_the_episode_exactly(machine):
    m = get_machine(machine)
    backend = SimBackend(m)
    for seed in range(4):
        g = random_graph(30, 10 + seed, p_edge=0.1)
        env = ScheduleEnv(graphs=g, machine=m, max_nodes=32)
        _, info, _ = play(env, np.random.default_rng(seed), p_wait=0.3, seed=seed)
        plan: Plan = info["plan"]
        plan.validate(g, m)
        replay = backend.run(g, plan)
        assert replay.makespan == info["makespan"]  # exact, not approximate
        got, want = replay.by_op(), info["trace"].by_op()
        assert all((got[k].start, got[k].end, got[k].device, got[k].threads)
                   == (want[k].start, want[k].end, want[k].device, want[k].threads) for k in want)


# ------------------------------------------------------------------ actions
def test_invalid_actions_raise_clear_errors(graph):
    m = get_machine("dgx1-4v100")
    env = ScheduleEnv(graphs=graph, machine=m, max_nodes=32)
    lay = ActionLayout(32)
    with pytest.raises(ResetNeeded):
        env.step(0)
    with pytest.raises(ResetNeeded):
        env.action_masks()
    env.reset(seed=0)
    ready = env._state.ready_ops()
    waiting = next(i for i in range(len(graph.ops)) if i not in ready)
    cases = [
        (lay.wait, "nothing is running"),
        (lay.encode(31, 0, 0), "padding"),
        (lay.encode(waiting, 0, 0), "waiting for its inputs"),
        (lay.encode(ready[0], 6, 0), "device 6"),
        (lay.encode(ready[0], 1, 1), "levels"),  # a GPU has one level (1 stream slot)
        (lay.n, "outside"),
        (-1, "outside"),
        (1.5, "one integer"),
    ]
    for action, message in cases:
        with pytest.raises(InvalidActionError, match=message):
            env.step(action)
    env.step(lay.encode(ready[0], 0, len(m.cpu.thread_levels()) - 1))  # all 40 CPU cores
    if len(env._state.ready_ops()):
        other = env._state.ready_ops()[0]
        with pytest.raises(InvalidActionError, match="free slots"):
            env.step(lay.encode(other, 0, 0))
    # refused actions changed nothing: the episode still runs to a valid end
    mask = env.action_masks()
    assert mask.dtype == bool and mask.shape == (lay.n,)
    terminated = False
    while not terminated:
        _, _, terminated, _, info = env.step(int(np.flatnonzero(env.action_masks())[0]))
    info["plan"].validate(graph, m)
    with pytest.raises(ResetNeeded):
        env.step(lay.wait)


def test_mask_allows_exactly_the_accepted_actions(graph):
    m = get_machine("2x2080ti")
    env = ScheduleEnv(graphs=graph, machine=m, max_nodes=32)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(8):
        mask = env.action_masks()
        invalid = np.flatnonzero(~mask)
        for a in rng.choice(invalid, size=20, replace=False):
            with pytest.raises(InvalidActionError):
                env.step(int(a))
        valid = np.flatnonzero(mask)
        _, _, terminated, _, _ = env.step(int(valid[rng.integers(len(valid))]))
        if terminated:
            break


def test_action_space_sample_is_valid(graph):
    env = ScheduleEnv(graphs=graph, machine="knl-68", max_nodes=32)
    env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(20):
        a = env.action_space.sample()
        assert env.action_masks()[a]
        if env.step(a)[2]:
            env.reset()


# --------------------------------------------------------------- coarsening
def test_coarsen_partitions_into_an_acyclic_graph():
    g = random_graph(120, 3, p_edge=0.05)
    cost = np.random.default_rng(0).random(120)
    co = coarsen(g, 20, cost=cost, max_edges=30)
    assert len(co.graph.ops) <= 20 and len(co.graph.edge_bytes) <= 30
    members = sorted(i for grp in co.groups for i in grp)
    assert members == list(range(120))
    for k, grp in enumerate(co.groups):
        assert co.graph.ops[k].flops == pytest.approx(sum(g.ops[i].flops for i in grp))
    for (s, d) in g.edge_bytes:  # every edge goes forward (or stays inside a group)
        assert co.group_of[s] <= co.group_of[d]
    assert coarsen(g, 200).identity


def test_large_graph_is_coarsened_and_the_plan_covers_every_op():
    m = get_machine("xeon-8180-2s")
    g = random_graph(150, 5, p_edge=0.03)
    env = ScheduleEnv(graphs=g, machine=m, max_nodes=16)
    obs, info0 = env.reset(seed=0)
    assert info0["coarsened"] and obs["node_mask"].sum() <= 16
    rewards, info, _ = play(env, np.random.default_rng(0), seed=0)
    assert info["coarsened"]
    plan = info["plan"]
    plan.validate(g, m)
    assert set(plan.assignments) == {op.id for op in g.ops}
    trace = SimBackend(m).run(g, plan)  # the mapped-back plan runs on the original graph
    assert trace.makespan >= lower_bound(g, m) * (1 - 1e-12)
    assert info["makespan"] >= info["lower_bound"] * (1 - 1e-12)
    assert sum(rewards) == pytest.approx(-info["makespan"] / info["reference"], rel=1e-9)


def test_machine_too_large_for_the_layout_is_refused(graph):
    from opsched.errors import MachineError

    big = Machine("big", (Device("cpu", "cpu", 256, 40.0, 20.0, 8.0),))
    env = ScheduleEnv(graphs=graph, machine=big)
    with pytest.raises(MachineError, match="MAX_LEVELS"):
        env.reset(seed=0)


def test_empty_graph_is_refused_and_no_graph_means_random_dags():
    from opsched.errors import GraphError

    with pytest.raises(GraphError, match="no ops"):
        ScheduleEnv(graphs=OpGraph((), (), name="empty"), machine="knl-68").reset(seed=0)
    env = ScheduleEnv(machine="knl-68")
    sizes = {env.reset(seed=s)[1]["n_ops"] for s in range(6)}
    assert all(20 <= n <= 60 for n in sizes) and len(sizes) > 1  # a fresh graph per episode
    assert env.reset(seed=3)[1]["graph"] == env.reset(seed=3)[1]["graph"]  # seeded


def test_noise_is_seeded(graph):
    env = ScheduleEnv(graphs=graph, machine="xeon-8180-2s", max_nodes=32, noise=0.3)
    a = play(env, np.random.default_rng(1), seed=4)[1]["makespan"]
    b = play(env, np.random.default_rng(1), seed=4)[1]["makespan"]
    c = play(env, np.random.default_rng(1), seed=5)[1]["makespan"]
    assert a == b and a != c


# ------------------------------------------------------------ property test
MACHINES = [small_cpu(2), small_cpu(3), get_machine("xeon-8180-2s"), get_machine("knl-68"),
            get_machine("dgx1-4v100"), get_machine("2x2080ti"), get_machine("4xa6000")]


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 22))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    flops = draw(st.lists(st.sampled_from([0.0, 1e4, 3e6, 2e8, 5e9]), min_size=n, max_size=n))
    nbytes = draw(st.lists(st.sampled_from([0.0, 1e3, 1e5, 1e7]), min_size=n, max_size=n))
    ops = tuple(Op(f"v{i}", f"v{i}", kinds[i], flops[i], nbytes[i], nbytes[i]) for i in range(n))
    pairs = [(j, i) for i in range(n) for j in range(i)]
    chosen = draw(st.lists(st.sampled_from(pairs), max_size=2 * n, unique=True)) if pairs else []
    edges = tuple(Edge(f"v{j}", f"v{i}", nbytes[j]) for j, i in chosen)
    return OpGraph(ops, edges, name=f"hyp{n}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=graphs(), machine=st.sampled_from(MACHINES), max_nodes=st.sampled_from([4, 24]),
       seed=st.integers(0, 2**16), p_wait=st.sampled_from([0.0, 0.3, 0.8]))
def test_property_random_episodes(g, machine, max_nodes, seed, p_wait):
    env = ScheduleEnv(graphs=g, machine=machine, max_nodes=max_nodes)
    rewards, info, steps = play(env, np.random.default_rng(seed), p_wait=p_wait, seed=seed, check_obs=True)
    plan = info["plan"]
    plan.validate(g, machine)  # a valid Plan for the original graph, every op covered
    assert steps <= 2 * len(g.ops)
    assert info["makespan"] >= lower_bound(g, machine) * (1 - 1e-12)
    assert sum(rewards) == pytest.approx(-info["makespan"] / info["reference"], rel=1e-9, abs=1e-12)
    if not info["coarsened"]:
        assert SimBackend(machine).run(g, plan).makespan == info["makespan"]


# --------------------------------------------------------- vectorised use
def _make_env(seed: int):
    def thunk():
        return ScheduleEnv(graphs=[random_graph(12, seed), random_graph(8, seed + 1)], machine="dgx1-4v100",
                           max_nodes=16)
    return thunk


def test_subproc_vec_env_with_masks():
    from sb3_contrib.common.maskable.utils import get_action_masks
    from stable_baselines3.common.vec_env import SubprocVecEnv

    # fork: the workers need no fresh interpreter (the env itself never touches torch or threads)
    venv = SubprocVecEnv([_make_env(0), _make_env(5)], start_method="fork")
    try:
        venv.seed(0)
        venv.reset()
        rng = np.random.default_rng(0)
        ends = 0
        for _ in range(60):
            masks = get_action_masks(venv)
            assert masks.shape == (2, ActionLayout(16).n) and masks.dtype == bool
            actions = np.array([rng.choice(np.flatnonzero(m)) for m in masks])
            _, rewards, dones, infos = venv.step(actions)
            assert np.all(rewards <= 0)
            for d, info in zip(dones, infos, strict=True):
                if d:
                    ends += 1
                    assert isinstance(info["plan"], Plan)
        assert ends >= 2
    finally:
        venv.close()


# ----------------------------------------------------------------- real mode
class CountingBackend(SimBackend):
    """A stand-in "real" backend: the simulator with noise, counting its runs."""

    name = "counting"
    measured = True
    runs = 0

    def __init__(self, machine):
        super().__init__(machine, noise=0.2, seed=0)

    def run(self, graph, plan, seed=None):
        CountingBackend.runs += 1
        return super().run(graph, plan, seed)


def test_real_mode_corrects_the_final_reward_and_caches(graph, monkeypatch):
    import opsched.backends.registry as registry

    monkeypatch.setattr(registry, "get_backend", lambda name, machine: CountingBackend(machine))
    env = ScheduleEnv(graphs=graph, machine="xeon-8180-2s", max_nodes=32, backend="counting",
                      real_warmup=1, real_repeats=3)
    CountingBackend.runs = 0
    _, info0 = env.reset(seed=0)
    assert CountingBackend.runs == 4  # the measured sequential reference: 1 warm-up + 3 repeats
    env.reset(seed=0)
    assert CountingBackend.runs == 4  # cached
    rewards, info, _ = play(env, np.random.default_rng(0), seed=0)
    assert CountingBackend.runs == 8
    assert info["measured_makespan"] == info["makespan"] != info["sim_makespan"]
    assert sum(rewards) == pytest.approx(-info["measured_makespan"] / info["reference"], rel=1e-9)
    assert set(info["measured_op_times"]) == {op.id for op in graph.ops}
    play(env, np.random.default_rng(0), seed=0)  # the same decisions: the same plan, not re-measured
    assert CountingBackend.runs == 8
    env.close()


def _torch_graph():
    pytest.importorskip("opsched.backends.torch_cpu")
    torch = pytest.importorskip("torch")
    from torch import nn

    from opsched.importers.torch_fx import from_torch

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(64, 8)

        def forward(self, x):
            return self.c(torch.cat([torch.relu(self.a(x)), torch.tanh(self.b(x))], dim=1))

    torch.manual_seed(0)
    return from_torch(Two().eval(), (torch.randn(4, 32),), name="two")


def test_real_torch_mode_check_env_and_episode():
    from gymnasium.utils.env_checker import check_env

    g = _torch_graph()
    env = gym.make(REAL_ENV_ID, graphs=[g], real_warmup=1, real_repeats=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker warning fails the test
            check_env(env.unwrapped)
        rewards, info, _ = play(env.unwrapped, np.random.default_rng(0), seed=0)
        assert info["measured_makespan"] > 0
        assert sum(rewards) == pytest.approx(-info["measured_makespan"] / info["reference"], rel=1e-9)
        assert set(info["measured_op_times"]) == {op.id for op in g.ops}
    finally:
        env.close()


def test_real_torch_mode_sb3_check_env():
    from stable_baselines3.common.env_checker import check_env

    g = _torch_graph()
    env = ScheduleEnv(graphs=[g], backend="torch-cpu", real_warmup=0, real_repeats=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker warning fails the test
            check_env(env)
    finally:
        env.close()


def test_env_speed_bench_smoke(tmp_path):
    import json

    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(repo / "bench" / "env_speed.py"), "--ops", "20", "--steps", "50",
                          "--windows", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "env_speed.json").read_text())["rows"]
