"""Fitting a backend's runtime model: measure plans on the real backend, fit what the profile misses.

``opsched profile`` measures, after the ops alone, a set of plans of the graph
(:func:`make_plans`: one op at a time with per-op thread variants, co-running
orders, the heuristics, mixed and random plans) on the real runtime, stores
the measurements beside the profiles (one record per graph and machine,
:func:`save_record`), and refits the backend's
:class:`~opsched.engine.models.runtime.TorchCPURuntime` on every record of this
machine (:func:`fit_runtime`, term by term), saved as
``<profiles>/runtime/<machine>/torch-cpu.json`` (:func:`runtime_path`).

Measurements run in a subprocess started with the runtime's allocator
settings (``TorchCPUBackend.recommended_env``), each plan in a child forked
from it (:func:`run_forked`), interleaved over rounds; a sample taken while
other processes used the cores is retried (see :func:`worker_main`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from opsched.cache import profiles_dir
from opsched.engine.contracts import PerfModel, RuntimeModel
from opsched.engine.models.runtime import TorchCPURuntime, cold_weight_bytes
from opsched.engine.profiles import ProfileError
from opsched.graph import OpGraph
from opsched.machine import Machine
from opsched.plan import Plan
from opsched.trace import Trace

RECORD_FORMAT = "opsched.runtime-measurements/1"
#: Kinds a framework hands to a multi-threaded library kernel (the by-kind rule).
WIDE_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Plans whose per-op measured durations are kept (to compare op by op with the profile).
DETAIL_PLANS = ("seq-1t", "seq-all")
#: A measured sample is *quiet* when other processes used at most this many cores during it.
QUIET_CORES = 0.3


# ====================================================================== plans
def make_plans(graph: OpGraph, machine: Machine, model: PerfModel, n_plans: int = 24,
               seed: int = 0) -> dict[str, Plan]:
    """At least ``n_plans`` distinct plans (distinct assignments) for ``graph`` on
    ``machine``, named; ``model`` prices the heuristics' decisions."""
    from opsched.plan import Assignment, Plan
    from opsched.policies import get_policy
    from opsched.policies.base import topo_priorities, window_after
    from opsched.policies.cpf import CriticalPathFirst

    cpu = machine.cpu
    levels = list(cpu.thread_levels())
    kmax = levels[-1]
    n = len(graph.ops)
    topo = graph.topo_index
    prio_topo = topo_priorities(graph, topo)
    chain = window_after(graph, topo, 1)
    table = model.time_table(graph, machine)
    d = machine.device_index["cpu"]
    t1 = table.on(d, 1)
    rank1 = graph.upward_rank_array(t1)
    big = np.asarray(t1) >= np.percentile(t1, 75)
    rng = np.random.default_rng(seed)
    plans: dict[str, Plan] = {}

    def add(name: str, threads: Sequence[int] | np.ndarray, prio: Sequence[float] | np.ndarray,
            after: Sequence[tuple[str, ...]] | None = None) -> None:
        asg = {op.id: Assignment("cpu", int(threads[i]), float(prio[i]), after[i] if after else ())
               for i, op in enumerate(graph.ops)}
        if all(p.assignments != asg for p in plans.values()):
            plans[name] = Plan.build(graph, machine, asg, policy=name)

    def add_plan(name: str, plan: Plan) -> None:
        if all(p.assignments != plan.assignments for p in plans.values()):
            plans[name] = Plan(plan.assignments, plan.graph_fingerprint, plan.machine_fingerprint, name,
                               dict(plan.meta))

    ones = [1] * n
    # one op at a time: per-op thread variants
    add("seq-1t", ones, prio_topo, chain)
    add_plan("seq-all", get_policy("sequential").plan(graph, machine, model))
    add("seq-by-kind", [kmax if op.kind in WIDE_KINDS else 1 for op in graph.ops], prio_topo, chain)
    add("seq-by-size", [kmax if b else 1 for b in big], prio_topo, chain)
    for s in range(3):
        add(f"seq-rand-threads-{s}", rng.choice(levels, n), prio_topo, chain)
    # co-running executors of one thread: orders
    add("corun-1t-topo", ones, prio_topo)
    add("corun-1t-cpf", ones, rank1)
    add("corun-1t-anti-cpf", ones, -rank1)
    for s in range(3):
        add(f"corun-1t-rand-prio-{s}", ones, rng.random(n))
    # the heuristics
    for name in ("critical-path-first", "heft", "tf-default", "tf-recommended"):
        try:
            add_plan(name, get_policy(name).plan(graph, machine, model))
        except Exception as exc:  # a heuristic that cannot plan this graph is reported, not fatal
            print(f"  {graph.name}: {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    add_plan("cpf-all", CriticalPathFirst().plan_for(graph, machine, table, "cpu", kmax))
    # mixed: wide ops alone-ish, small ops co-running
    add("mixed-by-kind", [kmax if op.kind in WIDE_KINDS else 1 for op in graph.ops], rank1)
    add("mixed-by-size", [kmax if b else 1 for b in big], rank1)
    add("mixed-rand-threads", rng.choice(levels, n), rank1)
    k = 0
    while len(plans) < n_plans and k < 4 * n_plans:
        add_plan(f"random-{k}", get_policy("random", seed=seed + k).plan(graph, machine, model))
        k += 1
    return plans


def plan_digest(plan: Plan) -> str:
    """A short hash of a plan's assignments (what was measured must be what is simulated)."""
    import hashlib

    ops = plan.to_dict()["ops"]
    return hashlib.sha1(json.dumps(ops, sort_keys=True).encode()).hexdigest()[:12]



def simulate(graph: OpGraph, machine: Machine, model: PerfModel,
             plans: Mapping[str, Plan]) -> dict[str, float]:
    """Simulated wall time (seconds) of every plan: the makespan, plus waking
    the calling thread at the end when the model follows the runtime's threads
    (``meta["wake_end_s"]``, as the measured ``wall_s`` includes it)."""
    return {name: float(t.makespan + t.meta.get("wake_end_s", 0.0))
            for name, t in simulate_traces(graph, machine, model, plans).items()}


def simulate_traces(graph: OpGraph, machine: Machine, model: PerfModel,
                    plans: Mapping[str, Plan]) -> dict[str, Trace]:
    """The simulated trace of every plan."""
    from opsched.backends.sim import SimBackend

    sim = SimBackend(machine, model=model)
    return {name: sim.run(graph, p) for name, p in plans.items()}




# ================================================================ measurement
@dataclass(frozen=True)
class GraphRef:
    """How a measuring subprocess rebuilds an executable graph: its spec and size
    (:func:`opsched.specs.load_graph`); the fingerprint proves it is the same."""

    spec: str
    batch: int = 1
    width: float = 1.0
    seed: int = 0

    def load(self) -> OpGraph:
        from opsched.specs import load_graph

        return load_graph(self.spec, self.batch, self.width, self.seed)


def _child_run(machine: Machine, graph: OpGraph, plan: Plan, warmup: int, reps: int, detail: bool, fd: int) -> None:
    """In a forked child: warm up, time ``reps`` runs of ``plan``, write JSON to ``fd``, exit."""
    try:
        from opsched.backends.torch_cpu import TorchCPUBackend

        be = TorchCPUBackend(machine)
        for _ in range(warmup):
            be.run(graph, plan)
        walls, busy, ops = [], [], []
        for _ in range(reps):
            tr = be.run(graph, plan)
            walls.append(float(tr.meta["wall_s"]))
            busy.append(float(sum(e.end - e.start for e in tr.events)))
            if detail:
                ops.append({e.op: e.end - e.start for e in tr.events})
        out: dict[str, Any] = {"wall": float(np.median(walls)), "busy": float(np.median(busy))}
        if detail:
            out["ops"] = {k: float(np.median([o[k] for o in ops])) for k in ops[0]}
        data = json.dumps(out).encode()
    except BaseException as exc:  # reported by the parent, never lost
        import traceback

        data = json.dumps({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}).encode()
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os._exit(0)  # no atexit handlers, no finalizers of the parent's objects


def run_forked(machine: Machine, graph: OpGraph, plan: Plan, warmup: int, reps: int, detail: bool,
               timeout_s: float = 120.0) -> dict[str, Any]:
    """Measure ``plan`` in a child forked from this process (see :func:`worker_main` for why)."""
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child_run(machine, graph, plan, warmup, reps, detail, w)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeError(f"plan {plan.policy!r}: the measuring child ran past {timeout_s:.0f} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "the measuring child died without a result"}')
    if "error" in out:
        raise RuntimeError(f"plan {plan.policy!r}: {out['error']}")
    return out


def load_saved_plans(folder: Path, machine: Machine) -> tuple[dict[str, OpGraph], dict[str, dict[str, Plan]]]:
    """What a measuring worker reads: per subfolder of ``folder`` its graph,
    rebuilt from ``graph.json`` (a :class:`GraphRef`), and its plans
    (``<plan>.json``), each validated against that graph on ``machine`` - the
    fingerprints prove the worker's graph is the one the parent planned for."""
    graphs, plans = {}, {}
    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        ref = GraphRef(**json.loads((d / "graph.json").read_text()))
        graphs[d.name] = ref.load()
        plans[d.name] = {p.stem: Plan.load(p) for p in sorted(d.glob("*.json")) if p.name != "graph.json"}
        for p in plans[d.name].values():
            p.validate(graphs[d.name], machine)
    return graphs, plans


def worker_main(args: argparse.Namespace) -> None:
    """In the measurement subprocess: measure every plan of every model, interleaved.

    Each measurement runs in a child forked from this process: warm-up runs,
    then ``--reps`` timed runs, whose median is one sample.  Why a fresh child:
    the runtime's state carries over between plans in one process - every
    executor thread that runs a multi-threaded op gets its own OpenMP team,
    and once a process holds more OpenMP threads than cores, libgomp stops
    spin-waiting, so later multi-threaded ops in that process run several
    times slower (measured here: a 2-thread inline plan 1.5-3x slower after
    any plan that ran 2-thread ops on executor threads).  A plan deployed
    alone does not pay for the plans measured before it.  This process stays
    at one intra-op thread, so it never starts an OpenMP team of its own.

    Rounds visit every (model, plan) in turn - all models, so slow drift of
    the machine hits every model alike - starting further along each round.
    A sample taken while other processes used more than ``--quiet-cores``
    cores is taken again at the end of the round (after ``--settle-s``), up
    to ``--max-tries`` times while the measurement is within ``--budget-s``;
    the least contended attempt is kept."""
    import torch

    torch.set_num_threads(1)  # before any op runs: no OpenMP team in the parent of the forks
    torch.set_grad_enabled(False)
    from opsched.timing import ContentionMeter
    machine = Machine.from_dict(json.loads((Path(args.plans) / "machine.json").read_text()))
    graphs, plans = load_saved_plans(Path(args.plans), machine)
    pairs = [(m, p) for m in plans for p in plans[m]]
    out: dict[str, Any] = {m: {"walls": {p: [] for p in ps}, "busy": {p: [] for p in ps},
                               "others": {p: [] for p in ps}, "op_durations": {}} for m, ps in plans.items()}
    op_times: dict[tuple[str, str], dict[str, list[float]]] = {
        (m, p): {op.id: [] for op in graphs[m].ops} for m, p in pairs if p in DETAIL_PLANS}
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    retries = kept_busy = rounds = 0
    for r in range(args.rounds):
        shift = (r * len(pairs)) // max(1, args.rounds)
        pending = [(pair, 0) for pair in pairs[shift:] + pairs[:shift]]
        best: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        while pending:
            (m, p), tries = pending.pop(0)
            with ContentionMeter(children=True) as meter:
                res = run_forked(machine, graphs[m], plans[m][p], args.warmup, args.reps, (m, p) in op_times)
            if (m, p) not in best or meter.others_cores < best[(m, p)][0]:
                best[(m, p)] = (meter.others_cores, res)
            if (meter.others_cores > args.quiet_cores and tries + 1 < args.max_tries
                    and time.perf_counter() - t_start < args.budget_s):  # past the budget: no more retries
                retries += 1
                pending.append(((m, p), tries + 1))
                time.sleep(args.settle_s)  # let another process's burst pass
        for (m, p), (others, res) in best.items():
            o = out[m]
            o["walls"][p].append(res["wall"])
            o["busy"][p].append(res["busy"])
            o["others"][p].append(others)
            kept_busy += others > args.quiet_cores
            if (m, p) in op_times:
                for op, t in res["ops"].items():
                    op_times[(m, p)][op].append(t)
        rounds += 1
        print(json.dumps({"round": rounds}), flush=True)
        if rounds >= args.min_rounds and time.perf_counter() - t_start > args.budget_s:
            break
    for (m, p), d in op_times.items():
        out[m]["op_durations"][p] = {op: float(np.median(v)) for op, v in d.items()}
    Path(args.result).write_text(json.dumps({
        "models": out, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "elapsed_s": time.perf_counter() - t_start, "rounds": rounds, "retries": retries,
        "samples_not_quiet": kept_busy, "quiet_cores": args.quiet_cores, "reps": args.reps,
        "max_tries": args.max_tries,
        "warmup": args.warmup, "torch": torch.__version__}))


def measure(machine: Machine, graphs: Mapping[str, GraphRef], plans: Mapping[str, Mapping[str, Plan]], *,
            rounds: int = 3,
            warmup: int = 2, reps: int = 3, budget_s: float = 120.0, min_rounds: int = 2,
            quiet_cores: float = QUIET_CORES, settle_s: float = 0.3, max_tries: int = 2,
            on_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the measurement worker (:func:`worker_main`) on ``{name: {plan name: plan}}``
    for ``machine`` (this machine's CPU as the plans describe it), each name's
    graph rebuilt from ``graphs[name]``; returns its record."""
    from opsched.backends.torch_cpu import recommended_env

    with tempfile.TemporaryDirectory(prefix="opsched_runtime_") as tmp:
        pdir = Path(tmp) / "plans"
        pdir.mkdir()
        (pdir / "machine.json").write_text(json.dumps(machine.to_dict()))
        for m, ps in plans.items():
            (pdir / m).mkdir(parents=True)
            (pdir / m / "graph.json").write_text(json.dumps(graphs[m].__dict__))
            for name, p in ps.items():
                p.save(pdir / m / f"{name}.json")
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "opsched.backends.runtime_fit", "--worker", "--plans", str(pdir),
               "--rounds", str(rounds), "--warmup", str(warmup), "--budget-s", str(budget_s),
               "--min-rounds", str(min_rounds), "--quiet-cores", str(quiet_cores), "--settle-s", str(settle_s),
               "--reps", str(reps), "--max-tries", str(max_tries), "--result", str(result)]
        env = {**os.environ, **recommended_env(), "PYTHONUNBUFFERED": "1"}
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    if line.startswith("{") and on_round is not None:
                        on_round(json.loads(line).get("round", 0))
                rc = proc.wait()
            except BaseException:  # Ctrl-C: no measuring worker is left behind
                proc.kill()
                proc.wait()
                raise
            if rc != 0:
                err.seek(0)
                raise ProfileError(f"the measurement worker failed (exit {rc}):\n" + err.read()[-3000:])
        return json.loads(result.read_text())


# ==================================================================== metrics
def ape(simulated: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """Absolute percentage errors ``|sim - real| / real``."""
    s, m = np.asarray(simulated, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(s - m) / m


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (NaN for fewer than 3 points or a constant side)."""
    from scipy.stats import spearmanr

    if len(x) < 3 or np.ptp(np.asarray(x, dtype=float)) == 0 or np.ptp(np.asarray(y, dtype=float)) == 0:
        return float("nan")
    # scipy makes its result class at import (_make_tuple_bunch): pyright sees no fields on it
    return float(spearmanr(x, y).statistic)  # pyright: ignore[reportAttributeAccessIssue]


def scores(simulated: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """MdAPE, p90 APE, Spearman, share within 15%, and the median ratio sim / real."""
    e = ape(simulated, measured)
    return {"plans": int(len(e)), "mdape": float(np.median(e)), "p90_ape": float(np.percentile(e, 90)),
            "within_15": float(np.mean(e <= 0.15)), "spearman": spearman(simulated, measured),
            "median_ratio": float(np.median(np.asarray(simulated) / np.asarray(measured)))}



# ================================================================ calibration
#: Grids for the co-run terms of the runtime calibration (seconds of GIL-held
#: host time per op; flat co-run slowdown; OpenMP team overhead per multi-threaded op).
HOST_GRID = (0.0, 2e-6, 4e-6, 6e-6, 8e-6, 12e-6, 16e-6, 24e-6, 32e-6, 48e-6, 64e-6, 96e-6)
C0_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
#: Hand-off (thread wake-up) latencies tried (seconds).
HANDOFF_GRID = (0.0, 10e-6, 20e-6, 30e-6, 45e-6, 60e-6, 80e-6, 100e-6, 130e-6, 160e-6)
TEAM_GRID = (0.0, 20e-6, 50e-6, 100e-6, 150e-6, 200e-6, 300e-6, 400e-6, 600e-6, 800e-6, 1000e-6)
#: OpenMP helper spin windows tried (seconds; libgomp's default spin measured ~8.4 ms here).
SPIN_GRID = (0.0, 0.5e-3, 1e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 10e-3, 12e-3, 16e-3)


def never_coruns(trace: Any) -> bool:
    """True when no two ops of ``trace`` overlap in time."""
    ev = sorted(trace.events, key=lambda e: e.start)
    end = -np.inf
    for e in ev:
        if e.start < end - 1e-12:
            return False
        end = max(end, e.end)
    return True


def _log_err(sim: float, real: float) -> float:
    return abs(float(np.log(sim / real)))


def team_wakes(graph: Any, trace: Any) -> int:
    """How many ops of a serial trace wake an idle OpenMP team (what
    ``TorchCPURuntime.thread_switch_s`` prices, as :class:`SimBackend`
    counts it): multi-threaded ops entering a parallel region after an op that
    used no team of that size."""
    ops = {op.id: op for op in graph.ops}
    last, n = 0, 0
    for e in sorted(trace.events, key=lambda e: e.start):
        if e.threads == 1:
            last = 1
        elif TorchCPURuntime.opens_parallel_region(ops[e.op]):
            n += last != e.threads
            last = e.threads
    return n


def op_level_rows(run: RuntimeRun, plan: str) -> tuple[np.ndarray, ...]:
    """Per op of a DETAIL plan: raw time, cold weight bytes, activation bytes, measured duration."""
    return run.op_raw[plan], run.cold, run.act, run.op_measured[plan]


def fit_runtime(runs: Sequence[RuntimeRun], machine: Machine, base: PerfModel) -> TorchCPURuntime:
    """The :class:`~opsched.engine.models.runtime.TorchCPURuntime` that best explains ``runs``' measurements,
    term by term, each from the measurements it alone affects:

    1. op by op, in the plans whose per-op durations were kept (``DETAIL_PLANS``,
       serial): ``duration = max(insitu_factor * t, cold_byte_s * cold_bytes +
       act_byte_s * activation_bytes) + o`` (robust least squares on absolute
       errors relative to the plan's total, so long ops weigh as they weigh in a
       makespan); the executor's own cost between ops is the median of ``(wall
       - sum of durations) / n_ops``; ``op_overhead_s`` is ``o`` plus it;
    2. plans that never co-run (a makespan is then a sum over ops): the team
       wake-up cost ``thread_switch_s`` per :func:`team_wakes`, minimising
       absolute log errors (1-D, bounded);
    3. co-running plans of one-thread ops: the GIL host time and the flat
       co-run slowdown, by coordinate search on grids (simulated);
    4. co-running plans with multi-threaded ops: the OpenMP helpers' spin
       window (``spin_s``), then the hand-off cost again with it (step 2's
       scores) and the spin window again - without the spin term the hand-off
       cost stands in for the one-thread ops slowed by spinning helpers -, and
       the OpenMP team overhead, each on a grid (simulated)."""
    from scipy.optimize import least_squares, minimize_scalar

    from opsched.engine.models.runtime import INSITU_REF_S, PlanningModel

    alpha, o_in, cold, act, gap, expo, overlap = 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0
    detail = [(r, p) for r in runs for p in r.op_measured if p in r.op_raw and r.serial.get(p, False)]
    if detail:
        parts = [op_level_rows(r, p) for r, p in detail]
        scale = np.array([1.0, 1e-5, 1e-10, 1e-10, 1.0])  # units: 10 us; seconds per byte at 10 GB/s

        def resid(x: np.ndarray, overlap: float) -> np.ndarray:
            a, o, b, g, e = x * scale
            out = []
            for t, c, ac, y in parts:
                comp = a * t * (np.maximum(t, 1e-7) / INSITU_REF_S) ** e
                stream = b * c + g * ac
                pred = (np.maximum(comp, stream) if overlap else comp + stream) + o
                out.append((pred - y) / y.sum() * np.sqrt(len(y)))
            return np.concatenate(out)

        # Both structures (streams overlapping the computation, or adding to it);
        # the max() has no gradient in the stream terms while no op is stream-bound:
        # start from several stream speeds and keep the best fit.
        fits = [(least_squares(resid, x0=np.array([1.0, 0.5, b0, b0 / 5, 0.0]), args=(overlap,),
                               bounds=([0.3, 0.0, 0.0, 0.0, -0.5], [3.0, 20.0, 10.0, 10.0, 0.5]),
                               loss="soft_l1", f_scale=0.01), overlap)
                for overlap in (1.0, 0.0) for b0 in (0.0, 0.1, 1.0, 5.0)]
        fit, overlap = min(fits, key=lambda f: f[0].cost)
        alpha, o_in, cold, act, expo = (float(v) for v in fit.x * scale)
        gap = max(0.0, float(np.median([(r.measured(p) - r.op_measured[p].sum()) / len(r.op_measured[p])
                                        for r, p in detail])))
    overhead = o_in + gap

    op_terms = {"insitu_factor": alpha, "cold_byte_s": cold, "act_byte_s": act, "insitu_exp": expo,
                "stream_overlap": overlap}
    fitted_on = tuple(r.name for r in runs)

    def cal(h: float, c: float, team: float, switch: float, handoff: float, spin: float = 0.0) -> TorchCPURuntime:
        return TorchCPURuntime(overhead, h, c, thread_switch_s=switch, team_overhead_s=team, handoff_s=handoff,
                                  spin_s=spin, fitted_on=fitted_on, **op_terms)

    def err(group: str, h: float, c: float, team: float, switch: float, handoff: float, spin: float = 0.0) -> float:
        model = PlanningModel(base, cal(h, c, team, switch, handoff, spin))
        total = 0.0
        for r in runs:
            ps = {p: r.plans[p] for p in r.plans if r.group(p) == group}
            if ps:
                sims = simulate(r.graph, machine, model, ps)
                total += sum(_log_err(sims[p], r.measured(p)) for p in ps)
        return total

    # 2. team wake-ups and hand-offs.  A plan that never co-runs takes the sum of
    #    its ops plus n_wakes * thread_switch_s + n_handoffs * handoff_s (both
    #    counted on a probe simulation): for each hand-off cost on a grid, the best
    #    team wake-up cost on those plans (1-D, bounded), scored on them and on the
    #    co-running plans with multi-threaded ops (simulated), which separate the two.
    switch = handoff = 0.0
    has_mt = any(r.group(p) == "corun-mt" for r in runs for p in r.plans)
    serial = [(r, p) for r in runs for p in r.plans if r.serial[p]]
    if serial:
        probe = PlanningModel(base, cal(0.0, 0.0, 0.0, 0.0, 1e-12))
        traces = {r.name: simulate_traces(r.graph, machine, probe, {p: r.plans[p] for p in r.plans if r.serial[p]})
                  for r in runs}
        base_s = np.array([traces[r.name][p].makespan for r, p in serial])
        n_h = np.array([len(traces[r.name][p].meta.get("handoff_wait", {}))
                        + (traces[r.name][p].meta.get("wake_end_s", 0.0) > 0) for r, p in serial], dtype=float)
        n_sw = np.array([r.switches[p] for r, p in serial], dtype=float)
        real = np.array([r.measured(p) for r, p in serial])

        def serial_fit(handoff: float) -> tuple[float, float]:
            def f(w: float) -> float:
                return float(np.abs(np.log((base_s + n_sw * w + n_h * handoff) / real)).sum())
            if not n_sw.any():
                return 0.0, f(0.0)
            res = minimize_scalar(f, bounds=(0.0, 500e-6), method="bounded", options={"xatol": 1e-7})
            return float(res.x), float(res.fun)

        def handoff_err(x: float, h: float = 0.0, c: float = 0.0, spin: float = 0.0) -> float:
            w, e = serial_fit(x)
            return e + (err("corun-mt", h, c, 0.0, w, x, spin) if has_mt else 0.0)

        handoff = _argmin_1d(handoff_err, HANDOFF_GRID)
        switch = serial_fit(handoff)[0]

    # 3. co-running one-thread ops: GIL host time and flat co-run slowdown (coordinate search);
    # 4. co-running multi-threaded ops: several OpenMP teams.
    h = c = team = spin = 0.0
    if any(r.group(p) == "corun-1t" for r in runs for p in r.plans):
        for _ in range(2):  # coordinate search
            h = _argmin_1d(lambda x, c=c: err("corun-1t", x, c, 0.0, switch, handoff), HOST_GRID)
            c = _argmin_1d(lambda x, h=h: err("corun-1t", h, x, 0.0, switch, handoff), C0_GRID)
    if has_mt:
        for again in (False, True):  # spin window, then hand-off and spin once more (coordinate search)
            if again and serial:
                handoff = _argmin_1d(lambda x, spin=spin: handoff_err(x, h, c, spin), HANDOFF_GRID)
                switch = serial_fit(handoff)[0]
            spin = _argmin_1d(lambda x, sw=switch, ho=handoff: err("corun-mt", h, c, 0.0, sw, ho, x), SPIN_GRID)
        team = _argmin_1d(lambda x: err("corun-mt", h, c, x, switch, handoff, spin), TEAM_GRID)
    return cal(h, c, team, switch, handoff, spin)


def _argmin_1d(f: Any, grid: Sequence[float]) -> float:
    """The grid point minimising ``f`` (first on ties)."""
    vals = [f(x) for x in grid]
    return float(grid[int(np.argmin(vals))])




# ====================================================================== runs
@dataclass
class RuntimeRun:
    """One graph's plans, their simulations with the performance model alone, and their measurements."""

    name: str
    graph: OpGraph
    plans: dict[str, Plan]
    sim_raw: dict[str, float]
    serial: dict[str, bool]  # the plan never co-runs two ops (its raw simulated trace has no overlap)
    switches: dict[str, int]  # OpenMP team wake-ups of a serial plan (team_wakes)
    cold: np.ndarray  # per op, weight bytes it is the first of the run to read (cold_weight_bytes)
    act: np.ndarray  # per op, activation bytes it reads and writes (bytes_total - param_bytes)
    op_raw: dict[str, np.ndarray]  # DETAIL_PLANS: per op, the raw model's time at the plan's thread count
    op_measured: dict[str, np.ndarray]  # DETAIL_PLANS: per op, the measured duration in the run (median)
    walls: dict[str, list[float]]  # per plan, one sample per round (seconds)
    busy: dict[str, list[float]]  # per plan, the sum of op durations of the same samples
    others: dict[str, list[float]]  # per plan, other processes' cores during each sample

    def measured(self, plan: str) -> float:
        return float(np.median(self.walls[plan]))

    def group(self, plan: str) -> str:
        """``serial`` (never co-runs), ``corun-1t`` (co-runs, every op one thread)
        or ``corun-mt`` (co-runs and has multi-threaded ops)."""
        if self.serial[plan]:
            return "serial"
        multi = any(a.threads > 1 for a in self.plans[plan].assignments.values())
        return "corun-mt" if multi else "corun-1t"


def simulate_raw(graph: OpGraph, machine: Machine, perf: PerfModel, plans: Mapping[str, Plan]
                 ) -> tuple[dict[str, float], dict[str, bool], dict[str, int], dict[str, np.ndarray]]:
    """Per plan: the raw simulated makespan, whether it never co-runs, its team
    wake-ups (serial plans), and per op its simulated duration (``DETAIL_PLANS``)."""
    traces = simulate_traces(graph, machine, perf, plans)
    serial = {name: never_coruns(t) for name, t in traces.items()}
    return ({name: float(t.makespan) for name, t in traces.items()}, serial,
            {name: team_wakes(graph, t) if serial[name] else 0 for name, t in traces.items()},
            {name: _op_times(graph, t) for name, t in traces.items() if name in DETAIL_PLANS})


def runtime_run(name: str, graph: OpGraph, plans: Mapping[str, Plan], measured: Mapping[str, Any],
                machine: Machine, perf: PerfModel) -> RuntimeRun:
    """A :class:`RuntimeRun` from a worker's measurements of ``plans`` (``measured``:
    walls, busy, others and op_durations per plan)."""
    sim_raw, serial, switches, op_raw = simulate_raw(graph, machine, perf, plans)
    act = np.array([max(0.0, op.bytes_total - op.param_bytes) for op in graph.ops])
    op_measured = {p: np.array([d[op.id] for op in graph.ops]) for p, d in measured.get("op_durations", {}).items()
                   if p in op_raw and all(op.id in d for op in graph.ops)}
    return RuntimeRun(name, graph, dict(plans), sim_raw, serial, switches, cold_weight_bytes(graph), act, op_raw,
                      op_measured, dict(measured["walls"]), dict(measured["busy"]), dict(measured["others"]))


def _op_times(graph: OpGraph, trace: Any) -> np.ndarray:
    """Per op (graph order), its duration in ``trace``."""
    d = {e.op: e.end - e.start for e in trace.events}
    return np.array([d[op.id] for op in graph.ops])


# ===================================================================== store
def runtime_dir(machine: Machine, cache_dir: str | Path | None = None) -> Path:
    """Where ``machine``'s runtime measurements and models live, beside its profiles
    (keyed by its CPU: the runtimes modelled here run on the CPU)."""
    return profiles_dir(cache_dir) / "runtime" / machine.cpu_only().hardware_fingerprint()


def runtime_path(machine: Machine, backend: str = "torch-cpu", cache_dir: str | Path | None = None) -> Path:
    """The fitted runtime model of ``backend`` on ``machine``."""
    return runtime_dir(machine, cache_dir) / f"{backend}.json"


def load_runtime(machine: Machine, backend: str = "torch-cpu",
                 cache_dir: str | Path | None = None) -> RuntimeModel | None:
    """The stored runtime model of ``backend`` on ``machine``, or None when none was fitted."""
    from opsched.backends.registry import spec

    cls = spec(backend).runtime_model_class()
    path = runtime_path(machine, backend, cache_dir)
    if cls is None or not path.is_file():
        return None
    return cls.load(path)


def record_path(graph: OpGraph, machine: Machine, backend: str = "torch-cpu",
                cache_dir: str | Path | None = None) -> Path:
    return runtime_dir(machine, cache_dir) / f"{backend}_{graph.fingerprint()}.json"



def save_record(graph: OpGraph, ref: GraphRef, machine: Machine, plans: Mapping[str, Plan],
                measured: Mapping[str, Any], meta: Mapping[str, Any], backend: str = "torch-cpu",
                cache_dir: str | Path | None = None) -> Path:
    """Store one graph's measured plans (the graph itself too, with its
    per-op cold weight bytes: the refit needs no model import)."""
    from opsched.io import atomic_write_text

    g = graph.to_dict()
    g["meta"] = {**g.get("meta", {}), "cold_weight_bytes": cold_weight_bytes(graph).tolist()}
    body = {"format": RECORD_FORMAT, "backend": backend, "machine": machine.fingerprint(),
            "graph_spec": ref.__dict__, "graph": g, "plans": {k: p.to_dict() for k, p in plans.items()},
            "measured": dict(measured), **dict(meta),
            "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    path = record_path(graph, machine, backend, cache_dir)
    atomic_write_text(path, json.dumps(body, indent=1) + "\n")
    return path


def load_runs(machine: Machine, perf: PerfModel, backend: str = "torch-cpu",
              cache_dir: str | Path | None = None) -> list[RuntimeRun]:
    """Every stored record of ``backend`` on ``machine`` as a :class:`RuntimeRun`
    (an unreadable record is skipped with a warning)."""
    import warnings

    runs = []
    for path in sorted(runtime_dir(machine, cache_dir).glob(f"{backend}_*.json")):
        try:
            data = json.loads(path.read_text())
            if data.get("format") != RECORD_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {RECORD_FORMAT!r}")
            graph = OpGraph.from_dict(data["graph"], where=str(path))
            plans = {k: Plan.from_dict(v) for k, v in data["plans"].items()}
            for p in plans.values():
                p.validate(graph, machine)
            runs.append(runtime_run(graph.name, graph, plans, data["measured"], machine, perf))
        except Exception as exc:  # noqa: BLE001 - one bad record must not hide the others
            warnings.warn(f"skipping runtime measurements {path}: {type(exc).__name__}: {exc}", stacklevel=2)
    return runs


def calibrate(graph: OpGraph, ref: GraphRef, machine: Machine, perf: PerfModel, *, n_plans: int = 16,
              rounds: int = 3, warmup: int = 1, reps: int = 3, budget_s: float = 90.0,
              cache_dir: str | Path | None = None, on_round: Callable[[int], None] | None = None
              ) -> tuple[TorchCPURuntime, list[RuntimeRun]]:
    """Measure ``n_plans`` plans of ``graph`` on the PyTorch CPU runtime, store
    them, and refit the runtime model on every stored record of ``machine``
    (this graph's included); returns the model (saved) and the runs it was fitted on."""
    plans = make_plans(graph, machine, perf, n_plans)
    t0 = time.time()
    load0 = os.getloadavg()
    meas = measure(machine, {"g": ref}, {"g": plans}, rounds=rounds, warmup=warmup, reps=reps, budget_s=budget_s,
                   min_rounds=min(2, rounds), on_round=on_round)
    save_record(graph, ref, machine, plans, meas["models"]["g"], {
        "rounds": meas["rounds"], "warmup": warmup, "reps": reps, "seconds": round(time.time() - t0, 2),
        "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
        "samples_not_quiet": meas["samples_not_quiet"], "torch": meas.get("torch")}, cache_dir=cache_dir)
    runs = load_runs(machine, perf, cache_dir=cache_dir)
    model = fit_runtime(runs, machine, perf)
    model.save(runtime_path(machine, "torch-cpu", cache_dir))
    return model, runs




# ====================================================================== worker
def _parse_worker(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m opsched.backends.runtime_fit",
                                 description="the runtime measurement worker (started by opsched profile)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--plans", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--quiet-cores", type=float, default=QUIET_CORES)
    ap.add_argument("--settle-s", type=float, default=0.3)
    ap.add_argument("--max-tries", type=int, default=2)
    return ap.parse_args(argv)


if __name__ == "__main__":
    worker_main(_parse_worker(None))
