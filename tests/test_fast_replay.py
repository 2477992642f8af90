"""The fused makespan replay (opsched.engine.fast_replay) against the general one.

Planners and local search read only a replay's makespan, so they take the
fused loop (compiled by numba where it is installed); it must give the
general replay's makespan bit for bit wherever it applies, compiled and run
as Python alike, and step aside (to the general replay) wherever it does not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched.engine.fast_replay import fast_makespan, supports
from opsched.engine.models.analytic import AnalyticModel
from opsched.engine.sim import prepare, replay_lists, replay_makespan
from opsched.errors import ExecutionError
from opsched.machine import get_machine
from opsched.synthetic import generate

MACHINES = ("knl-68", "xeon-8180-2s", "dgx1-4v100", "2x2080ti", "cpu:4:50:30", "cpu:4:50:10000", "hard:busy:922",
            "hard:busy:923")


def _machine(name: str):
    from opsched.specs import load_machine

    return load_machine(name) if name.startswith("hard:") else get_machine(name)


def _both(s, dev, thr, prio, after, noise=None):
    """(general makespan, fused makespan); "stall" where the replay stalls.  Where the fused
    loop applies, its Python form must give the compiled one's makespan too."""
    out = []
    for f in (lambda: float(replay_lists(s, dev, thr, prio, after, noise)[0].now),
              lambda: replay_makespan(s, dev, thr, prio, after, noise)):
        try:
            out.append(f())
        except ExecutionError:
            out.append("stall")
    if supports(s):
        try:
            python = fast_makespan(s, dev, thr, prio, after, noise, jit=False)
        except ExecutionError:
            python = "stall"
        assert python == out[1], "the loop run as Python and compiled differ"
    return out


def _random_plan(s, rng, holds: float, off_level: float):
    """Random devices, threads (a level, or now and then any count), priorities with ties, holds."""
    dev = [int(rng.integers(s.n_dev)) for _ in range(s.n)]
    thr = [int(rng.integers(1, s.caps[d] + 1)) if rng.random() < off_level
           else int(s.levels[d][int(rng.integers(len(s.levels[d])))]) for d in dev]
    prio = [float(rng.integers(0, max(2, s.n // 2))) for _ in range(s.n)]  # ties: graph order decides
    after = None
    if holds:  # now and then several holds on one op, repeats, itself and its predecessors among them
        after = [tuple(int(x) for x in rng.integers(0, s.n, int(rng.random() < holds) * int(rng.integers(1, 4))))
                 for _ in range(s.n)]
    return dev, thr, prio, after


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(("layered", "erdos_renyi", "watts_strogatz")), n_ops=st.integers(1, 60),
       seed=st.integers(0, 10_000), machine=st.sampled_from(MACHINES), holds=st.sampled_from((0.0, 0.15)),
       off_level=st.sampled_from((0.0, 0.2)), noisy=st.booleans())
def test_fused_makespan_is_the_general_replays_bit_for_bit(family, n_ops, seed, machine, holds, off_level, noisy):
    s = prepare(generate(family, n_ops, seed), _machine(machine))
    assert supports(s)
    rng = np.random.default_rng(seed)
    dev, thr, prio, after = _random_plan(s, rng, holds, off_level)
    noise = rng.lognormal(0.0, 0.3, s.n).tolist() if noisy else None
    general, fused = _both(s, dev, thr, prio, after, noise)
    assert fused == general


def test_a_stalling_plan_stalls_in_both():
    """Holds in both directions between two independent ops: neither can start."""
    g = generate("layered", 6, 1)
    s = prepare(g, get_machine("cpu:4:50:10000"))
    a, b = 0, next(i for i in range(1, s.n) if not s.preds[i] and i != 0)
    after = [()] * s.n
    after[a], after[b] = (b,), (a,)
    general, fused = _both(s, [0] * s.n, [1] * s.n, [0.0] * s.n, after)
    assert general == fused == "stall"


def test_the_heuristics_plans_score_the_same_on_the_coarse_episode():
    """What the exported scheduler replays: slot plans on a coarsened episode's static."""
    from opsched.engine.observe import prepare_episode
    from opsched.engine.slots import from_plan, makespan
    from opsched.policies import get_policy
    from opsched.policies.exported import load, pretrained_path

    g, m = generate("erdos_renyi", 180, 3), get_machine("dgx1-4v100")
    policy = load(pretrained_path())
    data = prepare_episode(g, m, None, policy.max_nodes, policy.max_edges)
    assert not data.coarsening.identity and supports(data.static)
    for name in ("heft", "critical-path-first", "cpa"):
        sp = from_plan(data, get_policy(name).plan(g, m), name)
        levels = data.static.levels
        thr = [int(levels[d][lv]) for d, lv in zip(sp.device, sp.level, strict=True)]
        general = float(replay_lists(data.static, sp.device, thr, [float(data.n - r) for r in sp.rank],
                                     [tuple(a) for a in sp.after] if any(sp.after) else None)[0].now)
        assert makespan(data, sp) == general


def test_busy_cores_are_priced_and_slow_the_run():
    """A machine with busy cores (other work on them) takes the fused loop, which must
    price the busy share: the same plan runs slower there than on the idle machine."""
    from dataclasses import replace

    from opsched.hard import hard_machine

    m = hard_machine("busy", 922)
    assert any(d.busy_cores for d in m.devices)
    idle = replace(m, devices=tuple(replace(d, busy_cores=0) for d in m.devices))
    g = generate("layered", 40, 2)
    busy_s, idle_s = prepare(g, m), prepare(g, idle)
    assert supports(busy_s)
    cpu = next(i for i, d in enumerate(m.devices) if not d.is_gpu)
    dev, thr = [cpu] * busy_s.n, [int(busy_s.levels[cpu][-1])] * busy_s.n
    prio = [0.0] * busy_s.n
    general, fused = _both(busy_s, dev, thr, prio, None)
    assert general == fused
    assert fused > replay_makespan(idle_s, dev, thr, prio, None)


def test_holds_on_itself_a_predecessor_or_twice_add_nothing():
    """What the compiled hold merge skips, as the general dispatch does."""
    g = generate("layered", 12, 4)
    s = prepare(g, get_machine("cpu:4:50:10000"))
    i = next(k for k in range(s.n) if s.preds[k])
    dev, thr, prio = [0] * s.n, [1] * s.n, [float(s.n - k) for k in range(s.n)]
    base = replay_makespan(s, dev, thr, prio, None)
    after = [()] * s.n
    after[i] = (i, s.preds[i][0], s.preds[i][0])
    general, fused = _both(s, dev, thr, prio, after)
    assert general == fused == base
    late = max(range(s.n), key=lambda k: -prio[k])  # the last op in the dispatch order
    after = [()] * s.n
    first = next(k for k in range(s.n) if not s.preds[k] and k != late)
    after[first] = (late, late)
    general, fused = _both(s, dev, thr, prio, after)
    assert general == fused


@pytest.mark.parametrize("why", ["runtime model", "another interference law"])
def test_what_the_fused_loop_does_not_price_takes_the_general_replay(why):
    from opsched.engine.models.ort_runtime import OrtRuntime
    from opsched.engine.models.runtime import PlanningModel

    g = generate("erdos_renyi", 40, 5)
    if why == "runtime model":
        s = prepare(g, get_machine("cpu:4:50:30"), PlanningModel(AnalyticModel(), OrtRuntime(handoff_s=20e-6)))
    else:
        class Harsher(AnalyticModel):
            def slowdown(self, device, demands):
                return 1.0 + 0.5 * np.asarray(demands) / max(device.mem_bandwidth_gbs, 1e-9)

        s = prepare(g, get_machine("cpu:4:50:30"), Harsher())
    assert not supports(s)
    rng = np.random.default_rng(1)
    for _ in range(5):
        dev, thr, prio, after = _random_plan(s, rng, 0.1, 0.0)
        general, fused = _both(s, dev, thr, prio, after)
        assert fused == general


def test_the_loop_is_compiled_and_its_cache_stays_out_of_the_checkout():
    """numba compiles the loop (it is a dependency), into opsched's cache folder, not next to the source."""
    import importlib.util
    import os
    from pathlib import Path

    import opsched.engine.fast_replay as fast
    from opsched.cache import root

    if importlib.util.find_spec("numba") is None or not fast.available():
        pytest.skip("numba is not installed or OPSCHED_NO_JIT is set: replays take the general loop")
    s = prepare(generate("layered", 12, 2), get_machine("cpu:4:50:30"))
    replay_makespan(s, [0] * s.n, [1] * s.n, [0.0] * s.n, None)
    loop = fast._compiled()
    assert loop is not fast._loop and loop.py_func is fast._loop
    source = Path(fast.__file__).parent / "__pycache__"
    assert not list(source.glob("fast_replay._loop*")), "numba wrote its cache next to the source"
    if not os.environ.get("NUMBA_CACHE_DIR"):
        assert list((root() / "numba").rglob("fast_replay._loop*"))


@pytest.mark.parametrize("machine", ["dgx1-4v100", "hard:busy:922", "cpu:4:50:30"])
def test_a_slot_plan_scores_the_same_on_both_replays(machine, monkeypatch):
    """``replay_slot_makespan`` (what local search calls): the compiled path reads the slot
    plan as it is, the general one gets per-op lists; one gate switches both."""
    import opsched.engine.sim as sim

    s = prepare(generate("erdos_renyi", 30, 7), _machine(machine))
    rng = np.random.default_rng(3)
    plans = []
    for _ in range(6):
        device = [int(rng.integers(s.n_dev)) for _ in range(s.n)]
        level = [int(rng.integers(len(s.levels[d]))) for d in device]
        rank = [int(x) for x in rng.permutation(s.n)]
        after = [tuple(int(x) for x in rng.integers(0, s.n, int(rng.random() < 0.2))) for _ in range(s.n)]
        plans.append((device, level, rank, after))
    def scores() -> list[float | str]:
        out: list[float | str] = []
        for p in plans:
            try:
                out.append(sim.replay_slot_makespan(s, *p))
            except ExecutionError:  # random holds may wait on each other both ways
                out.append("stall")
        return out

    fast = scores()
    monkeypatch.setattr(sim, "supports_fast", lambda _s: False)
    general = scores()
    assert fast == general and any(x != "stall" for x in fast)
