"""Why plans mixing multi-threaded and co-running one-thread ops run slow (issue 3).

The real runtime (``TorchCPUBackend``) runs every multi-threaded op on the
calling thread with the process's one OpenMP team and the one-thread ops on
executor threads pinned to their slots' CPUs.  In plans that mix the two,
the one-thread ops measured ~2x slower than in a chain.  Hypothesis: after
a parallel region libgomp's helper thread spin-waits (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY``) on a core that a worker now needs.

Finding (``runs/bench/mixed_plans.md``): the helper spins ~8 ms after each
region, and a worker *pinned* to its core runs at half speed while the other
core idles; so the runtime now runs such plans' workers unpinned (the
``default`` variant here; ``pin-always`` is the old behaviour), and the
environment variables, which would fix it too, cost eager PyTorch 2.2-2.6x.

This script measures a few plans of ``bench/sim_to_real.py`` (its
:func:`make_plans`, imported) under *variants* that can only be set when a
process starts - OpenMP's wait policy and spin count - plus unpinned
workers, and eager PyTorch (the module called directly, all cores) under
each, so the price of a variant for eager users is visible too.

One persistent worker process per variant (started with
:func:`~opsched.backends.torch_cpu.recommended_env` plus the variant's
variables; it stays at one intra-op thread so it never starts an OpenMP
team).  Each round the parent asks every variant in turn (starting one
further along each round) to measure everything once; each measurement runs
in a child forked from the worker (a fresh OpenMP team, no state from the
plan before): warm-up runs, then the median of ``--reps`` runs.  Per plan:
the wall time, the summed op durations (*busy*), and the *1-thread slowdown*:
summed durations of the plan's one-thread ops over the same ops' durations in
``seq-1t`` of the same round and variant (1.0 = they ran at chain speed),
split by whether the op overlapped a multi-threaded op.  Ratios to the
``default`` variant are taken within each round, then the median.

    python bench/mixed_plans.py                  # writes runs/bench/mixed_plans.{json,md}
    python bench/mixed_plans.py --rounds 3 --models lstm
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PLANS = ("seq-1t", "seq-all", "seq-by-kind", "corun-1t-cpf", "mixed-by-kind", "mixed-by-size", "random-0")
#: name -> (extra environment, TorchCPUBackend's ``pin``).  ``default`` is the
#: runtime as shipped (workers unpinned in plans with multi-threaded ops);
#: ``pin-always`` the runtime before issue 3's fix.
VARIANTS: dict[str, tuple[dict[str, str], bool | str]] = {
    "default": ({}, True),
    "pin-always": ({}, "always"),
    "nopin": ({}, False),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
    "spin0": ({"GOMP_SPINCOUNT": "0"}, True),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, True),
    "spin10k-always": ({"GOMP_SPINCOUNT": "10000"}, "always"),
}


# ================================================================== worker side
def _child(fn: Any) -> dict[str, Any]:
    """Run ``fn()`` in a forked child; return its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = json.dumps(fn()).encode()
        except BaseException as exc:  # reported by the parent, never lost
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "child died"}')
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def _spin_probe(reps: int = 7) -> dict[str, Any]:
    """How long the caller's OpenMP helper threads keep a CPU busy after a
    2-thread op ends: their CPU time (``/proc/self/task/*/schedstat``, ns)
    over 50 ms with the caller asleep, and one 1-thread op's slowdown
    started on another thread right after the 2-thread op vs 50 ms later."""
    import threading

    import torch

    torch.set_num_threads(2)
    a = torch.randn(384, 384)
    small = torch.randn(64, 64)
    me = str(threading.get_native_id())

    def cpu_ns() -> int:
        tot = 0
        for t in os.listdir("/proc/self/task"):
            if t != me:
                try:
                    with open(f"/proc/self/task/{t}/schedstat") as f:
                        tot += int(f.read().split()[0])
                except OSError:
                    pass
        return tot

    def one_thread_op(out: list[float]) -> None:
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        for _ in range(200):
            small @ small
        out.append(time.perf_counter() - t0)

    for _ in range(5):
        a @ a
    spins, right_after, later = [], [], []
    for _ in range(reps):
        time.sleep(0.05)
        a @ a
        c0 = cpu_ns()
        time.sleep(0.05)
        spins.append((cpu_ns() - c0) / 1e6)
        for sink, pause in ((right_after, 0.0), (later, 0.05)):
            time.sleep(0.05)
            a @ a
            time.sleep(pause)
            th = threading.Thread(target=one_thread_op, args=(sink,))
            th.start()
            th.join()
    return {"helper_cpu_ms_after_region": float(np.median(spins)),
            "one_thread_op_ms_right_after": 1e3 * float(np.median(right_after)),
            "one_thread_op_ms_50ms_later": 1e3 * float(np.median(later))}


def _measure_plan(machine: Any, graph: Any, plan: Any, pin: bool | str, warmup: int, reps: int) -> dict[str, Any]:
    from opsched.backends.torch_cpu import TorchCPUBackend

    be = TorchCPUBackend(machine, pin=pin)
    for _ in range(warmup):
        be.run(graph, plan)
    walls, durs, over = [], [], []
    idx = graph.index
    for _ in range(reps):
        tr = be.run(graph, plan)
        walls.append(tr.meta["wall_s"])
        d = [0.0] * len(graph.ops)
        o = [False] * len(graph.ops)
        mt = [(e.start, e.end) for e in tr.events if e.threads > 1]
        for e in tr.events:
            d[idx[e.op]] = e.end - e.start
            if e.threads == 1 and mt:
                o[idx[e.op]] = any(s < e.end and e.start < t for s, t in mt)
        durs.append(d)
        over.append(o)
    be.close()
    return {"wall": float(np.median(walls)), "ops": np.median(np.asarray(durs), axis=0).tolist(),
            "overlap": np.mean(np.asarray(over), axis=0).tolist()}


def _measure_eager(graph: Any, warmup: int, reps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    src = graph.source
    for _ in range(warmup):
        src.gm(*src.example_inputs)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        src.gm(*src.example_inputs)
        walls.append(time.perf_counter() - t0)
    return {"wall": float(np.median(walls))}


def worker_main(args: argparse.Namespace) -> None:
    """Load graphs and plans once; measure everything on each ``round K`` line of stdin."""
    import torch

    torch.set_num_threads(1)  # no OpenMP team in the parent of the forks
    torch.set_grad_enabled(False)
    from sim_to_real import load_saved_plans

    from opsched.machine import Machine
    from opsched.timing import ContentionMeter

    machine = Machine.probe()
    graphs, plans = load_saved_plans(Path(args.plans), machine)
    items = [(m, p) for m in plans for p in [*plans[m], "eager"]] + [("-", "spin-probe")]
    pin = {"true": True, "false": False, "always": "always"}[args.pin]
    proto = os.fdopen(os.dup(1), "w")  # libraries' prints cannot corrupt the protocol
    os.dup2(2, 1)
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        k = int(line.split()[1])
        shift = k % len(items)
        res: dict[str, Any] = {}
        for m, p in items[shift:] + items[:shift]:
            with ContentionMeter(children=True) as meter:
                if p == "spin-probe":
                    r = _child(_spin_probe)
                elif p == "eager":
                    r = _child(lambda m=m: _measure_eager(graphs[m], args.warmup, args.reps))
                else:
                    r = _child(lambda m=m, p=p: _measure_plan(machine, graphs[m], plans[m][p], pin,
                                                              args.warmup, args.reps))
            r["others"] = meter.others_cores
            res[f"{m}/{p}"] = r
        proto.write(json.dumps(res) + "\n")
        proto.flush()


# ================================================================== parent side
def _summary(samples: list[dict[str, Any]], graphs_threads: dict[str, list[int]]) -> dict[str, Any]:
    """Per (variant, model/plan): medians over rounds of wall, busy, 1-thread slowdown."""
    out: dict[str, Any] = {}
    variants = list(samples[0])
    for v in variants:
        out[v] = {}
        for key in samples[0][v]:
            m, p = key.split("/")
            if p == "spin-probe":
                out[v][key] = {f: float(np.median([rnd[v][key][f] for rnd in samples]))
                               for f in samples[0][v][key] if f != "others"}
                continue
            walls, busy, slow, slow_ov, slow_no, ratio = [], [], [], [], [], []
            for rnd in samples:
                r = rnd[v][key]
                walls.append(r["wall"])
                ratio.append(r["wall"] / rnd["default"][key]["wall"])
                if p == "eager":
                    continue
                ops = np.asarray(r["ops"])
                base = np.asarray(rnd[v][f"{m}/seq-1t"]["ops"])
                one = np.asarray(graphs_threads[f"{m}/{p}"]) == 1
                ov = np.asarray(r["overlap"]) >= 0.5
                busy.append(float(ops.sum()))
                if one.any():
                    slow.append(float(ops[one].sum() / base[one].sum()))
                if (one & ov).any():
                    slow_ov.append(float(ops[one & ov].sum() / base[one & ov].sum()))
                if (one & ~ov).any():
                    slow_no.append(float(ops[one & ~ov].sum() / base[one & ~ov].sum()))

            def med(x: list[float]) -> float | None:
                return float(np.median(x)) if x else None

            out[v][key] = {"wall_ms": 1e3 * med(walls), "wall_q1_ms": 1e3 * float(np.percentile(walls, 25)),
                           "wall_q3_ms": 1e3 * float(np.percentile(walls, 75)),
                           "busy_ms": None if not busy else 1e3 * med(busy), "vs_default": med(ratio),
                           "slow_1t": med(slow), "slow_1t_overlapping_mt": med(slow_ov),
                           "slow_1t_not_overlapping": med(slow_no),
                           "others_cores": med([rnd[v][key]["others"] for rnd in samples])}
    return out


def _fmt(x: float | None, f: str = "{:.2f}") -> str:
    return "-" if x is None else f.format(x)


def write_markdown(res: dict[str, Any], path: Path) -> None:
    s = res["summary"]
    lines = ["# Mixed plans: OpenMP wait policy, spin count and pinning (issue 3)", "",
             f"`{res['command']}` on {res['machine']}; torch {res['torch']}; {res['rounds']} rounds, "
             f"{res['warmup']} warm-up + median of {res['reps']} runs per sample, each in a fresh forked child; "
             f"{res['elapsed_s']:.0f} s; load average {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}.",
             "", "Variants: " + "; ".join(f"`{v}` = {e or '{}'}, pin={pin!r}"
                                          for v, (e, pin) in res["variants"].items()) + ".", "",
             "*x default*: wall / default's wall in the same round (median). *1t slow*: summed durations of "
             "the plan's one-thread ops / the same ops in seq-1t (same round, same variant); split into ops that "
             "overlapped a multi-threaded op (*ov. mt*) and the others.", ""]
    probe = "-/spin-probe"
    lines += ["## OpenMP helper spin after a 2-thread op (spin probe)", "",
              "| variant | helper CPU ms in 50 ms after the region | 200 small 1-thread matmuls right after, ms | "
              "same 50 ms later, ms |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {v} | {s[v][probe]['helper_cpu_ms_after_region']:.2f} | "
              f"{s[v][probe]['one_thread_op_ms_right_after']:.2f} | {s[v][probe]['one_thread_op_ms_50ms_later']:.2f} |"
              for v in s]
    lines.append("")
    for key in s["default"]:
        if key == probe:
            continue
        lines += [f"## {key}", "", "| variant | wall ms (q1-q3) | x default | busy ms | 1t slow | 1t slow ov. mt | "
                  "1t slow other | others' cores |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for v in s:
            r = s[v][key]
            lines.append(f"| {v} | {r['wall_ms']:.2f} ({r['wall_q1_ms']:.2f}-{r['wall_q3_ms']:.2f}) | "
                         f"{_fmt(r['vs_default'])} | {_fmt(r['busy_ms'])} | {_fmt(r['slow_1t'])} | "
                         f"{_fmt(r['slow_1t_overlapping_mt'])} | {_fmt(r['slow_1t_not_overlapping'])} | "
                         f"{_fmt(r['others_cores'])} |")
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="nasnet,lstm")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--profiles", default=str(REPO / "runs" / "profiles"))
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--pin", default="true", choices=("true", "false", "always"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    sys.path.insert(0, str(BENCH))
    import torch
    from sim_to_real import make_plans

    from opsched.backends.fitted import FittedModel
    from opsched.backends.torch_cpu import recommended_env
    from opsched.io import atomic_write_text
    from opsched.machine import Machine
    from opsched.specs import load_graph

    machine = Machine.probe()
    fitted = FittedModel.from_cache(machine, args.profiles)
    variants = {v: VARIANTS[v] for v in args.variants.split(",")}
    if "default" not in variants:
        variants = {"default": VARIANTS["default"], **variants}
    threads: dict[str, list[int]] = {}
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mixed_plans_") as tmp:
        for m in args.models.split(","):
            g = load_graph(f"zoo:{m}")
            ps = make_plans(g, machine, fitted)
            (Path(tmp) / m).mkdir()
            for name in PLANS:
                if name in ps:
                    ps[name].save(Path(tmp) / m / f"{name}.json")
                    threads[f"{m}/{name}"] = [ps[name][op.id].threads for op in g.ops]
        procs = {}
        for v, (extra, pin) in variants.items():
            env = {**os.environ, **recommended_env(), **extra, "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, __file__, "--worker", "--plans", tmp, "--warmup", str(args.warmup),
                   "--reps", str(args.reps), "--pin", str(pin).lower()]
            procs[v] = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        samples: list[dict[str, Any]] = []
        try:
            for v, p in procs.items():
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"variant {v}: worker failed to start (exit {p.poll()})")
            names = list(procs)
            for k in range(args.rounds):
                rnd = {}
                for v in names[k % len(names):] + names[:k % len(names)]:
                    procs[v].stdin.write(f"round {k}\n")
                    procs[v].stdin.flush()
                    line = procs[v].stdout.readline()
                    if not line:
                        raise RuntimeError(f"variant {v}: worker died in round {k}")
                    rnd[v] = json.loads(line)
                samples.append(rnd)
                print(f"round {k + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", flush=True)
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait(30)
    res = {"command": "python bench/mixed_plans.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": f"{machine.cpu.name} ({machine.cpu.cores} cores, {platform.node()})", "torch": torch.__version__,
           "rounds": args.rounds, "warmup": args.warmup, "reps": args.reps, "elapsed_s": time.time() - t0,
           "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
           "variants": {v: [e, pin] for v, (e, pin) in variants.items()},
           "summary": _summary(samples, threads), "samples": samples}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "mixed_plans.json", json.dumps(res, indent=1))
    write_markdown(res, out / "mixed_plans.md")
    print(f"wrote {out / 'mixed_plans.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
