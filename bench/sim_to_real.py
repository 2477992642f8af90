"""Sim-to-real: simulated against measured makespans of many plans per zoo model.

Target (issue 3): for each zoo model on this machine, over at least 20
different plans, median absolute percentage error (MdAPE) <= 15% and
Spearman rank correlation >= 0.8 between the simulated and the measured
makespan (per model and pooled).

Plans (:func:`make_plans`): sequential chains at 1 and all threads; per-op
thread variants in a chain (by kind, by predicted size, random per op);
co-running variants (executors of 1 thread with topological, critical-path,
anti-critical-path and random priorities); the heuristics (critical-path-first,
HEFT, TensorFlow's default and recommended settings); mixed plans (big ops
wide, small ops co-running); random plans (random threads and priorities).

Simulated: :class:`~opsched.backends.sim.SimBackend` with the performance
model fitted on the cached profiles (``FittedModel.from_cache``), reported
*raw* and *runtime-calibrated* (:class:`~opsched.backends.fitted.RuntimeCalibration`:
what running a whole plan adds to ops profiled alone in a loop - the
executor's per-op cost, weights and activations no longer in the caches,
waking an idle OpenMP team, the interpreter lock and co-run slowdown, the
cores an OpenMP team's helpers keep spinning on after a parallel region, and
the cost of several executor threads holding OpenMP teams; see
:func:`fit_calibration`).  The calibration is fitted on the measurements
of the *other* models only (leave one model out), so no model's figures come
from a fit to its own measurements; the fit on all models is saved for
other tools (``runs/bench/sim_to_real_calibration.json``).

The measurements are saved as soon as they are taken
(``sim_to_real_raw.json``: per plan the samples, per-op durations of
``DETAIL_PLANS``, the plans' digests); ``--from-raw FILE`` re-analyses such a
file (or a full ``sim_to_real.json``) without measuring, provided the plans -
made from the cached profiles - are still the same (checked by digest).

Measured: :class:`~opsched.backends.torch_cpu.TorchCPUBackend` ``meta['wall_s']``
in a subprocess per model started with :func:`recommended_env` (glibc's
thresholds must be set at process start), after a warm-up, over interleaved
rounds (each round runs every plan once, starting one further along), the
median per plan.  Other processes' CPU use is recorded per round; a shared
machine inflates errors, so the load average is part of the figures.

    python bench/sim_to_real.py              # writes runs/bench/sim_to_real.{json,md,png}
    python bench/sim_to_real.py --quick      # fewer rounds (smoke run)
    python bench/sim_to_real.py --models resnet50,lstm --rounds 15
    python bench/sim_to_real.py --from-raw runs/bench/sim_to_real_raw.json --out /tmp/s2r   # re-analysis
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ZOO_MODELS = ("inception", "resnet50", "nasnet", "randwire", "lstm", "transformer")
TARGET_MDAPE = 0.15
TARGET_SPEARMAN = 0.8
#: Kinds a framework hands to a multi-threaded library kernel (the by-kind rule).
WIDE_KINDS = frozenset({"conv", "matmul", "rnn", "attention"})
#: Plans whose per-op measured durations are kept (to compare op by op with the profile).
DETAIL_PLANS = ("seq-1t", "seq-all")
#: A measured round is *quiet* when other processes used at most this many cores during it.
QUIET_CORES = 0.3


# ====================================================================== plans
def make_plans(graph: Any, machine: Any, model: Any, n_plans: int = 24, seed: int = 0) -> dict[str, Any]:
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
    plans: dict[str, Any] = {}

    def add(name: str, threads: Sequence[int], prio: Sequence[float], after: Sequence[tuple[str, ...]] | None = None
            ) -> None:
        asg = {op.id: Assignment("cpu", int(threads[i]), float(prio[i]), after[i] if after else ())
               for i, op in enumerate(graph.ops)}
        if all(p.assignments != asg for p in plans.values()):
            plans[name] = Plan.build(graph, machine, asg, policy=name)

    def add_plan(name: str, plan: Any) -> None:
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


def plan_digest(plan: Any) -> str:
    """A short hash of a plan's assignments (what was measured must be what is simulated)."""
    import hashlib

    ops = plan.to_dict()["ops"]
    return hashlib.sha1(json.dumps(ops, sort_keys=True).encode()).hexdigest()[:12]


def simulate(graph: Any, machine: Any, model: Any, plans: Mapping[str, Any]) -> dict[str, float]:
    """Simulated wall time (seconds) of every plan: the makespan, plus waking
    the calling thread at the end when the model follows the runtime's threads
    (``meta["wake_end_s"]``, as the measured ``wall_s`` includes it)."""
    return {name: float(t.makespan + t.meta.get("wake_end_s", 0.0))
            for name, t in simulate_traces(graph, machine, model, plans).items()}


def simulate_traces(graph: Any, machine: Any, model: Any, plans: Mapping[str, Any]) -> dict[str, Any]:
    """The simulated trace of every plan."""
    from opsched.backends.sim import SimBackend

    sim = SimBackend(machine, model=model)
    return {name: sim.run(graph, p) for name, p in plans.items()}


# ================================================================ measurement
def _child_run(machine: Any, graph: Any, plan: Any, warmup: int, reps: int, detail: bool, fd: int) -> None:
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


def run_forked(machine: Any, graph: Any, plan: Any, warmup: int, reps: int, detail: bool,
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


def load_saved_plans(folder: Path, machine: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """What a measuring worker reads: per zoo model (a subfolder of ``folder``)
    its graph, rebuilt here, and its plans (``<plan>.json``), each validated
    against that graph on ``machine`` - the fingerprints prove the worker's
    graph is the one the parent planned for."""
    from opsched.plan import Plan
    from opsched.specs import load_graph

    graphs, plans = {}, {}
    for d in sorted(folder.iterdir()):
        graphs[d.name] = load_graph(f"zoo:{d.name}")
        plans[d.name] = {p.stem: Plan.load(p) for p in sorted(d.glob("*.json"))}
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
    from opsched.machine import Machine
    from opsched.timing import ContentionMeter

    machine = Machine.probe()
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


def measure(plans: Mapping[str, Mapping[str, Any]], args: argparse.Namespace, on_round: Any = None
            ) -> dict[str, Any]:
    """Run the measurement worker (see :func:`worker_main`) on ``{model: {name: plan}}``."""
    from opsched.backends.torch_cpu import recommended_env

    with tempfile.TemporaryDirectory(prefix="sim_to_real_") as tmp:
        pdir = Path(tmp) / "plans"
        for m, ps in plans.items():
            (pdir / m).mkdir(parents=True)
            for name, p in ps.items():
                p.save(pdir / m / f"{name}.json")
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--plans", str(pdir),
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--budget-s", str(args.budget_s),
               "--quiet-cores", str(args.quiet_cores), "--settle-s", str(args.settle_s), "--reps", str(args.reps),
               "--max-tries", str(args.max_tries),
               "--result", str(result)]
        env = {**os.environ, **recommended_env(), "PYTHONUNBUFFERED": "1"}
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("{") and on_round is not None:
                    on_round(json.loads(line).get("round", 0))
            if proc.wait() != 0:
                err.seek(0)
                raise RuntimeError(f"the measurement worker failed (exit {proc.returncode}):\n" + err.read()[-3000:])
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
    return float(spearmanr(x, y).statistic)


def scores(simulated: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """MdAPE, p90 APE, Spearman, share within 15%, and the median ratio sim / real."""
    e = ape(simulated, measured)
    return {"plans": int(len(e)), "mdape": float(np.median(e)), "p90_ape": float(np.percentile(e, 90)),
            "within_15": float(np.mean(e <= TARGET_MDAPE)), "spearman": spearman(simulated, measured),
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


@dataclass
class ModelRun:
    """One zoo model's plans, their raw simulations and their measurements."""

    name: str
    graph: Any
    plans: dict[str, Any]
    sim_raw: dict[str, float]
    serial: dict[str, bool]  # the plan never co-runs two ops (its raw simulated trace has no overlap)
    switches: dict[str, int]  # OpenMP team wake-ups of a serial plan (team_wakes)
    cold: np.ndarray  # per op, weight bytes it is the first of the run to read (fitted.cold_weight_bytes)
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
    ``RuntimeCalibration.thread_switch_s`` prices, as :class:`SimBackend`
    counts it): multi-threaded ops entering a parallel region after an op that
    used no team of that size."""
    from opsched.backends.fitted import CalibratedModel

    ops = {op.id: op for op in graph.ops}
    last, n = 0, 0
    for e in sorted(trace.events, key=lambda e: e.start):
        if e.threads == 1:
            last = 1
        elif CalibratedModel.opens_parallel_region(ops[e.op]):
            n += last != e.threads
            last = e.threads
    return n


def op_level_rows(run: ModelRun, plan: str) -> tuple[np.ndarray, ...]:
    """Per op of a DETAIL plan: raw time, cold weight bytes, activation bytes, measured duration."""
    return run.op_raw[plan], run.cold, run.act, run.op_measured[plan]


def fit_calibration(runs: Sequence[ModelRun], machine: Any, base: Any) -> Any:
    """The :class:`RuntimeCalibration` that best explains ``runs``' measurements,
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

    from opsched.backends.fitted import INSITU_REF_S, CalibratedModel, RuntimeCalibration

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

    def cal(h: float, c: float, team: float, switch: float, handoff: float, spin: float = 0.0) -> Any:
        return RuntimeCalibration(overhead, h, c, thread_switch_s=switch, team_overhead_s=team, handoff_s=handoff,
                                  spin_s=spin, fitted_on=fitted_on, **op_terms)

    def err(group: str, h: float, c: float, team: float, switch: float, handoff: float, spin: float = 0.0) -> float:
        model = CalibratedModel(base, cal(h, c, team, switch, handoff, spin))
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
        probe = CalibratedModel(base, cal(0.0, 0.0, 0.0, 0.0, 1e-12))
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
def reused_digests(data: Mapping[str, Any], model: str) -> dict[str, str | None]:
    """``{plan: digest}`` of ``model`` in an earlier raw file (``digests``) or full report (``rows``)."""
    if "digests" in data:
        return dict(data["digests"].get(model, {}))
    return {x["plan"]: x.get("digest") for x in data.get("rows", []) if x["model"] == model}


def collect(models: Sequence[str], machine: Any, fitted: Any, args: argparse.Namespace,
            reuse: Mapping[str, Any] | None = None, raw_path: Path | None = None
            ) -> tuple[list[ModelRun], dict[str, Any]]:
    """Plans, raw simulations and measurements of every model (a rich progress bar),
    and the measurement worker's record, saved to ``raw_path`` as soon as it is
    taken.  ``reuse``: an earlier raw file or report to take the measurements
    from instead (it must hold exactly these plans, checked by digest)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from opsched.backends.fitted import cold_weight_bytes
    from opsched.backends.sim import SimBackend
    from opsched.specs import load_graph

    sim = SimBackend(machine, model=fitted)
    prepared = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("sim-to-real", total=len(models) + args.rounds)
        for m in models:
            bar.update(task, description=f"{m}: plans + simulation")
            graph = load_graph(f"zoo:{m}")
            plans = make_plans(graph, machine, fitted, args.plans_per_model)
            traces = {name: sim.run(graph, p) for name, p in plans.items()}
            serial = {name: never_coruns(t) for name, t in traces.items()}
            prepared.append((m, graph, plans, {name: float(t.makespan) for name, t in traces.items()}, serial,
                             {name: team_wakes(graph, t) if serial[name] else 0 for name, t in traces.items()},
                             {name: _op_times(graph, t) for name, t in traces.items() if name in DETAIL_PLANS}))
            bar.update(task, advance=1)
        if reuse is not None:
            for m, _, plans, *_ in prepared:
                digests = reused_digests(reuse, m)
                if m not in reuse["measurement"]["models"] or digests != {k: plan_digest(p) for k, p in plans.items()}:
                    raise SystemExit(f"--from-raw: the file has no measurements of exactly these {m!r} plans "
                                     "(a different performance model or profile cache makes different plans)")
            meas = reuse["measurement"]
        else:
            bar.update(task, description=f"measuring {sum(len(x[2]) for x in prepared)} plans in rounds")
            meas = measure({m: plans for m, _, plans, *_ in prepared}, args,
                           lambda r: bar.update(task, completed=len(models) + r))
            if raw_path is not None:  # before any analysis: a failed fit never loses a measurement
                from opsched.io import atomic_write_text

                raw_path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(raw_path, json.dumps({
                    "format": "sim_to_real_raw/2", "measurement": meas,
                    "digests": {m: {k: plan_digest(p) for k, p in plans.items()} for m, _, plans, *_ in prepared},
                    "rows": [{"model": m, "plan": k, "measured_s": float(np.median(meas["models"][m]["walls"][k])),
                              "simulated_raw_s": sim_raw[k]}
                             for m, _, plans, sim_raw, *_ in prepared for k in plans]}, indent=1))
        bar.update(task, completed=len(models) + args.rounds, description="fitting the calibration")
    runs = []
    for m, graph, plans, sim_raw, serial, switches, op_raw in prepared:
        got = meas["models"][m]
        act = np.array([max(0.0, op.bytes_total - op.param_bytes) for op in graph.ops])
        op_measured = {p: np.array([d[op.id] for op in graph.ops]) for p, d in got.get("op_durations", {}).items()
                       if p in op_raw and all(op.id in d for op in graph.ops)}
        runs.append(ModelRun(m, graph, plans, sim_raw, serial, switches, cold_weight_bytes(graph), act, op_raw,
                             op_measured, got["walls"], got["busy"], got["others"]))
    return runs, meas


def _op_times(graph: Any, trace: Any) -> np.ndarray:
    """Per op (graph order), its duration in ``trace``."""
    d = {e.op: e.end - e.start for e in trace.events}
    return np.array([d[op.id] for op in graph.ops])


def analyse(runs: Sequence[ModelRun], machine: Any, fitted: Any) -> dict[str, Any]:
    """Rows per plan with the raw and the held-out calibrated simulation, and the scores."""
    from opsched.backends.fitted import CalibratedModel

    calibrations = {}
    rows = []
    for r in runs:
        held_in = [x for x in runs if x is not r]
        cal = fit_calibration(held_in, machine, fitted) if held_in else None
        calibrations[r.name] = cal.to_dict() if cal is not None else None
        sims = simulate(r.graph, machine, CalibratedModel(fitted, cal), r.plans) if cal is not None else {}
        for p in r.plans:
            w = r.walls[p]
            rows.append({"model": r.name, "plan": p, "ops": len(r.graph.ops), "serial": r.serial[p],
                         "group": r.group(p), "digest": plan_digest(r.plans[p]),
                         "measured_s": float(np.median(w)), "measured_q1_s": float(np.percentile(w, 25)),
                         "measured_q3_s": float(np.percentile(w, 75)),
                         "busy_s": float(np.median(r.busy[p])), "samples": len(w),
                         "simulated_raw_s": r.sim_raw[p], "simulated_s": sims.get(p, float("nan"))})
    cal_all = fit_calibration(runs, machine, fitted)

    def score(sel: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
        return scores([x[key] for x in sel], [x["measured_s"] for x in sel])

    per_model = {}
    for r in runs:
        sel = [x for x in rows if x["model"] == r.name]
        per_model[r.name] = {"raw": score(sel, "simulated_raw_s"),
                             "calibrated": score(sel, "simulated_s") if len(runs) > 1 else None,
                             "calibration": calibrations[r.name],
                             "others_cores_median": float(np.median([c for v in r.others.values() for c in v]))}
    pooled = {"raw": score(rows, "simulated_raw_s"),
              "calibrated": score(rows, "simulated_s") if len(runs) > 1 else None}
    for key in ("raw", "calibrated"):
        if pooled[key] is not None:
            pooled[key]["spearman_per_model_median"] = float(np.median(
                [v[key]["spearman"] for v in per_model.values()]))
    return {"rows": rows, "per_model": per_model, "pooled": pooled, "calibration_all": cal_all.to_dict()}


# ==================================================================== report
def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _met(s: Mapping[str, float] | None) -> str:
    if s is None:
        return "-"
    ok = s["mdape"] <= TARGET_MDAPE and s["spearman"] >= TARGET_SPEARMAN
    return "**met**" if ok else "missed"


def describe_calibration(c: Mapping[str, Any]) -> str:
    return (f"x{c['insitu_factor']:.2f} + {c['op_overhead_s'] * 1e6:.1f} us/op, team wake "
            f"{c['thread_switch_s'] * 1e6:.0f} us, cold weights "
            f"{1e-9 / c['cold_byte_s'] if c['cold_byte_s'] > 0 else float('inf'):.1f} GB/s, activations "
            f"{1e-9 / c['act_byte_s'] if c['act_byte_s'] > 0 else float('inf'):.0f} GB/s, "
            f"host {c['host_s'] * 1e6:.0f} us, c0 {c['corun_c0']:.2f}, team {c['team_overhead_s'] * 1e6:.0f} us, "
            f"hand-off {c.get('handoff_s', 0.0) * 1e6:.0f} us, spin {c.get('spin_s', 0.0) * 1e3:.1f} ms, "
            f"size exponent {c.get('insitu_exp', 0.0):+.2f}, "
            f"streams {'overlapped' if c.get('stream_overlap', 1.0) >= 1 else 'added'}")


def write_markdown(res: Mapping[str, Any], path: Path) -> None:
    la0, la1 = res["loadavg_start"], res["loadavg_end"]
    lines = [
        "# Sim-to-real: simulated vs measured makespans",
        "",
        f"`{res['command']}` on {res['machine']}; torch {res['torch']}; {res['elapsed_s']:.0f} s. "
        f"Load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} at start, "
        f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} at end; other processes used a median "
        f"{res['others_cores_median']:.2f} of the {res['cores']} cores during the samples.",
        "",
        f"Measured: `TorchCPUBackend` wall time (`meta['wall_s']`) in one worker process started with "
        f"`recommended_env()`; {res['rounds']} rounds each visit every (model, plan), all models interleaved, and "
        f"measure it in a fresh child forked from the worker ({res['warmup']} warm-up runs, then the median of "
        f"{res['reps']} runs = one sample), so no plan inherits another's OpenMP teams; the figure is the median "
        f"of the samples. A sample taken while other processes used more than {res['quiet_cores']} cores was "
        f"taken again (up to {res.get('max_tries', 3)} times, the quietest kept): {res['retries']} retries, "
        f"{res['samples_not_quiet']} "
        "samples kept above the limit. "
        f"Simulated: `SimBackend` with `FittedModel.from_cache` on `{res['profiles']}` (*raw*), and with the "
        "runtime calibration (`CalibratedModel`: in-situ factor on op times, per-op executor overhead, "
        "cold weights, activation traffic - fitted op by op on the per-op durations of seq-1t and seq-all -, "
        "size exponent of the in-situ factor, OpenMP team wake-up, hand-offs between the calling thread "
        "(multi-threaded ops) and the workers (one-thread ops), GIL host time, flat co-run slowdown, OpenMP "
        "helpers spinning after a parallel region (cores the co-running one-thread ops lose), throttled "
        "OpenMP teams - fitted on the plans "
        "they affect) fitted on the "
        "**other** models' measurements only (leave one model out; *calibrated*). Plan kinds: *serial* never "
        "co-runs, *corun-1t* co-runs one-thread ops, *corun-mt* co-runs and has multi-threaded ops.",
        f"Targets: MdAPE <= {TARGET_MDAPE:.0%}, Spearman >= {TARGET_SPEARMAN}.",
        "",
        "| model | ops | plans | MdAPE raw | Spearman raw | MdAPE calibrated | Spearman calibrated | "
        "p90 APE cal. | target (cal.) | calibration (held out: fitted on the other models) | others' cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for m, v in res["per_model"].items():
        raw, cal, c = v["raw"], v["calibrated"], v["calibration"]
        ops = next(x["ops"] for x in res["rows"] if x["model"] == m)
        cal_txt = describe_calibration(c) if c else "-"
        lines.append(
            f"| {m} | {ops} | {raw['plans']} | {_pct(raw['mdape'])} | {raw['spearman']:.2f} | "
            + (f"{_pct(cal['mdape'])} | {cal['spearman']:.2f} | {_pct(cal['p90_ape'])} | {_met(cal)} | "
               if cal else "- | - | - | - | ")
            + f"{cal_txt} | {v['others_cores_median']:.2f} |")
    pr, pc = res["pooled"]["raw"], res["pooled"]["calibrated"]
    lines.append(
        f"| **pooled** | | {pr['plans']} | {_pct(pr['mdape'])} | {pr['spearman']:.2f} | "
        + (f"{_pct(pc['mdape'])} | {pc['spearman']:.2f} | {_pct(pc['p90_ape'])} | {_met(pc)} | " if pc
           else "- | - | - | - | ")
        + "(per-model fits) | |")
    ca = res["calibration_all"]
    lines += [
        "",
        f"Pooled Spearman is over all (model, plan) points; the median of the per-model Spearman "
        f"coefficients is {pr['spearman_per_model_median']:.2f} raw"
        + (f", {pc['spearman_per_model_median']:.2f} calibrated." if pc else "."),
        f"Calibration fitted on all models (saved to `sim_to_real_calibration.json` for other tools, "
        f"not used for the figures above): {describe_calibration(ca)}.",
        "",
    ]
    for m in res["per_model"]:
        lines += [f"## {m}", "",
                  "| plan | kind | measured ms (q1-q3) | busy ms | sim raw ms | APE raw | sim cal. ms | APE cal. |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for x in (x for x in res["rows"] if x["model"] == m):
            me = x["measured_s"]
            lines.append(
                f"| {x['plan']} | {x['group']} | {_ms(me)} ({_ms(x['measured_q1_s'])}-"
                f"{_ms(x['measured_q3_s'])}) | {_ms(x['busy_s'])} | {_ms(x['simulated_raw_s'])} | "
                f"{_pct(abs(x['simulated_raw_s'] - me) / me)} | {_ms(x['simulated_s'])} | "
                f"{_pct(abs(x['simulated_s'] - me) / me)} |")
        lines.append("")
    path.write_text("\n".join(lines))


def plot(res: Mapping[str, Any], path: Path) -> None:
    """Simulated vs measured, log-log, one colour per model, the y = x line; raw and calibrated panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("simulated_raw_s", "raw fitted model"), ("simulated_s", "calibrated (held-out models)")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharex=True, sharey=True)
    rows = res["rows"]
    vals = [x[k] for x in rows for k in ("measured_s", "simulated_raw_s", "simulated_s") if np.isfinite(x[k])]
    lo, hi = min(vals) / 1.3 * 1e3, max(vals) * 1.3 * 1e3
    colours = plt.get_cmap("tab10")
    for ax, (key, title) in zip(axes, keys, strict=True):
        for j, m in enumerate(res["per_model"]):
            sel = [x for x in rows if x["model"] == m and np.isfinite(x[key])]
            if not sel:
                continue
            s = res["per_model"][m]["raw" if key == "simulated_raw_s" else "calibrated"]
            label = f"{m} (MdAPE {100 * s['mdape']:.0f}%, rho {s['spearman']:.2f})" if s else m
            ax.scatter([x["measured_s"] * 1e3 for x in sel], [x[key] * 1e3 for x in sel], s=18,
                       color=colours(j), label=label, alpha=0.8,
                       marker=["o" if x["serial"] else "^" for x in sel][0])
            co = [x for x in sel if not x["serial"]]
            ax.scatter([x["measured_s"] * 1e3 for x in co], [x[key] * 1e3 for x in co], s=18,
                       color=colours(j), marker="^", alpha=0.8)
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
        ax.plot([lo, hi], [lo * 1.15, hi * 1.15], "k:", lw=0.7)
        ax.plot([lo, hi], [lo / 1.15, hi / 1.15], "k:", lw=0.7, label="±15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured makespan (ms)")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, which="both", alpha=0.2)
    axes[0].set_ylabel("simulated makespan (ms)")
    fig.suptitle("Sim-to-real on this machine (o: plans that never co-run, ^: co-running plans)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ====================================================================== main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ZOO_MODELS), help="comma-separated zoo models")
    ap.add_argument("--plans-per-model", type=int, default=24, help="plans per model (at least 20)")
    ap.add_argument("--rounds", type=int, default=0, help="measured rounds: samples per plan (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each measurement")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per measurement (their median is one sample)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no further round after this many seconds of measuring (default 330; quick 90)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 1 warm-up + 2 runs (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"), help="output folder")
    ap.add_argument("--profiles", default=str(REPO / "runs" / "profiles"),
                    help="profile cache the fitted model is fitted on (default runs/profiles)")
    ap.add_argument("--from-raw", "--reuse", dest="from_raw", metavar="FILE",
                    help="re-analyse the measurements of an earlier run (its sim_to_real_raw.json or "
                         "sim_to_real.json) instead of measuring; the plans must be the same")
    # internal: the measurement subprocess
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--min-rounds", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--quiet-cores", type=float, default=QUIET_CORES,
                    help="a round counts as quiet when other processes used at most this many cores (default 0.3)")
    ap.add_argument("--settle-s", type=float, default=0.3, help="pause after a sample that was not quiet")
    ap.add_argument("--max-tries", type=int, default=2,
                    help="measurements of a plan per round at most when others are busy (the quietest is kept)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.budget_s = args.budget_s or (90.0 if args.quick else 330.0)
    if args.quick:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 2)
    if args.plans_per_model < 20 and not args.worker:
        ap.error("--plans-per-model must be at least 20 (the issue's target)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    from opsched.backends.fitted import FittedModel
    from opsched.machine import Machine

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ZOO_MODELS]
    if unknown:
        print(f"unknown zoo model(s) {unknown}; choose from {', '.join(ZOO_MODELS)}", file=sys.stderr)
        return 2
    reuse = None
    if args.from_raw:
        try:
            reuse = json.loads(Path(args.from_raw).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"--from-raw {args.from_raw}: cannot read it ({exc})", file=sys.stderr)
            return 2
        if not isinstance(reuse, dict) or "measurement" not in reuse:
            print(f"--from-raw {args.from_raw}: not a sim_to_real raw file or report (no 'measurement'); "
                  "files of the old format (before the per-plan digests) cannot be re-analysed", file=sys.stderr)
            return 2
    machine = Machine.probe()
    fitted = FittedModel.from_cache(machine, args.profiles)
    t0 = time.time()
    load0 = os.getloadavg()
    out = Path(args.out)
    runs, meas = collect(models, machine, fitted, args, reuse, None if reuse else out / "sim_to_real_raw.json")
    load1 = os.getloadavg()
    res = analyse(runs, machine, fitted)
    res.update({
        "command": "python bench/sim_to_real.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{machine.cpu.name} ({machine.cpu.cores} cores, {platform.node()})",
        "cores": machine.cpu.cores, "torch": meas.get("torch"), "python": platform.python_version(),
        "rounds": meas["rounds"], "warmup": meas["warmup"], "reps": meas["reps"], "elapsed_s": time.time() - t0,
        "quiet_cores": meas["quiet_cores"], "profiles": os.path.relpath(args.profiles, REPO),
        "loadavg_start": list(meas["loadavg_start"]), "loadavg_end": list(meas["loadavg_end"]),
        "loadavg_run": [list(load0), list(load1)],
        "others_cores_median": float(np.median([c for r in runs for v in r.others.values() for c in v])),
        "retries": meas["retries"], "samples_not_quiet": meas["samples_not_quiet"],
        "max_tries": meas.get("max_tries", 3),
        "reused_measurements_from": args.from_raw,
        "targets": {"mdape": TARGET_MDAPE, "spearman": TARGET_SPEARMAN},
        "measurement": meas,
    })
    out.mkdir(parents=True, exist_ok=True)
    from opsched.backends.fitted import RuntimeCalibration
    from opsched.io import atomic_write_text

    atomic_write_text(out / "sim_to_real.json", json.dumps(res, indent=1))
    write_markdown(res, out / "sim_to_real.md")
    plot(res, out / "sim_to_real.png")
    RuntimeCalibration.from_dict(res["calibration_all"]).save(out / "sim_to_real_calibration.json")
    for m, v in res["per_model"].items():
        c = v["calibrated"] or v["raw"]
        print(f"{m:12s} MdAPE raw {_pct(v['raw']['mdape']):>7s} rho {v['raw']['spearman']:5.2f} | "
              f"calibrated {_pct(c['mdape']):>7s} rho {c['spearman']:5.2f}")
    p = res["pooled"]["calibrated"] or res["pooled"]["raw"]
    print(f"{'pooled':12s} MdAPE raw {_pct(res['pooled']['raw']['mdape']):>7s} "
          f"rho {res['pooled']['raw']['spearman']:5.2f} | calibrated {_pct(p['mdape']):>7s} rho {p['spearman']:5.2f}")
    print(f"wrote {out / 'sim_to_real.md'} (load average {res['loadavg_start'][0]:.2f} -> "
          f"{res['loadavg_end'][0]:.2f} while measuring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
