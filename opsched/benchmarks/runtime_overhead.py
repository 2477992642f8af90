"""Runtime overhead of TorchCPUBackend over the plain node-by-node runner.

Target (issue 3): median overhead <= 5 us per op on a 500-op graph of tiny ops
(~2 us each, so the runtime's own cost dominates), then the same comparison
on a zoo model.  Overhead per op = (median plan time - median baseline time) /
ops; the ratio is the median over rounds of plan / baseline within a round.

    python -m opsched.benchmarks.runtime_overhead          # writes runs/bench/runtime_overhead.{json,md}
    python -m opsched.benchmarks.runtime_overhead --quick  # fewer rounds (smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import Timings, host_record, interleave, summary

TARGET_US = 5.0


def _reexec_with_env(argv: Sequence[str]) -> None:
    from opsched.backends.torch_cpu import recommended_env

    env = recommended_env()
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv], {**os.environ, **env})


def tiny_tree_module(n_ops: int = 500):
    """A module whose fx graph has ``n_ops`` tiny ops: leaves, a pairwise sum tree, a relu."""
    import torch
    from torch import nn

    leaves = n_ops // 2  # leaves + (leaves - 1) combines + 1 relu == n_ops for even n_ops

    class TinyTree(nn.Module):
        def forward(self, x):
            level = [x * (1.0 + 0.001 * i) for i in range(leaves)]
            while len(level) > 1:
                nxt = [level[j] + level[j + 1] for j in range(0, len(level) - 1, 2)]
                if len(level) % 2:
                    nxt.append(level[-1])
                level = nxt
            return torch.relu(level[0])

    return TinyTree().eval(), (torch.randn(4),)


def chain_plan(graph, machine, threads: int, policy: str):
    """Every op ``threads`` threads, each waiting for the previous one in graph order.

    Graph order (the importer's fx order, which is topological) is the order
    ``run_node_by_node`` uses: the comparison must not mix in an order effect
    (on the lstm zoo model, ``graph.topo_index`` order, which interleaves the
    two layers, runs ~2x slower than fx order at 1 thread - cache locality)."""
    from opsched.plan import Assignment, Plan

    n = len(graph.ops)
    asg = {op.id: Assignment("cpu", threads, float(n - i), (graph.ops[i - 1].id,) if i else ())
           for i, op in enumerate(graph.ops)}
    return Plan.build(graph, machine, asg, policy=policy)


def measure(configs: dict[str, Any], rounds: int, warmup: int) -> tuple[Timings, dict[str, list[float]]]:
    """:func:`opsched.timing.interleave` over the callables (wall times), and per
    configuration the process CPU time of each timed call (all threads: it shows
    a runtime that burns cycles - a spinning thread - and is less disturbed than
    wall time by other load on a shared machine)."""
    cpu: dict[str, list[float]] = {name: [] for name in configs}

    def clocked(name: str, fn: Any) -> Any:
        def call() -> float:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1 = time.perf_counter()
            cpu[name].append(time.process_time() - c0)
            return t1 - t0
        return call

    timings = interleave({name: clocked(name, fn) for name, fn in configs.items()}, warmup, rounds)
    return timings, {name: xs[warmup:] for name, xs in cpu.items()}  # the warm-up calls come first


def at_threads(k: int, fn):
    import torch

    def call():
        prev = torch.get_num_threads()
        torch.set_num_threads(k)
        try:
            return fn()
        finally:
            torch.set_num_threads(prev)

    return call


def summarize(measured: tuple[Timings, dict[str, list[float]]], baseline_of: dict[str, str],
              n_ops: int) -> dict[str, Any]:
    timings, cpu = measured
    times = timings.samples
    out: dict[str, Any] = {}
    for name, ts in times.items():
        med = summary(ts)["median"]
        cpu_med = summary(cpu[name])["median"]
        row: dict[str, Any] = {
            "median_ms": med * 1e3,
            "p10_ms": sorted(ts)[len(ts) // 10] * 1e3,
            "p90_ms": sorted(ts)[(9 * len(ts)) // 10] * 1e3,
            "cpu_median_ms": cpu_med * 1e3,
            "rounds": len(ts),
        }
        base = baseline_of.get(name)
        if base is not None:
            row["baseline"] = base
            row["overhead_us_per_op"] = (med - summary(times[base])["median"]) / n_ops * 1e6
            row["cpu_overhead_us_per_op"] = (cpu_med - summary(cpu[base])["median"]) / n_ops * 1e6
            row["ratio_vs_baseline"] = timings.ratios(base)[name]["median"]
        out[name] = row
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """The tiny graph is a reduction tree traced with torch.fx: 250 independent
    ``x * c`` leaves on a 4-element tensor, combined pairwise by ``+`` down to one
    value, then a ``relu``.  Configurations, timed end to end (``new_values``,
    every op, the output) and interleaved round by round:

    * ``node-by-node``: ``TorchSource.run_node_by_node`` (the baseline), with the
      caller at the plan's thread count;
    * ``sequential-1t``: every op 1 thread, an ``after`` chain forcing one total
      order - the executor-thread path (compiled plan, ready counters, slot pool,
      pinning) with no co-running, so every microsecond over the baseline is
      overhead; both ``execute`` (outputs) and ``run`` (plus the Trace);
    * ``inline-all``: every op on all cores - the fast path on the calling thread;
    * ``corun-1t``: every op 1 thread, no chain: independent leaves co-run on the
      executor threads (informational: tiny ops hold the GIL, so this measures
      hand-off cost, not a speed-up).

    Then the sequential 1-thread plan against node-by-node at 1 thread on a zoo
    model.  The process re-executes itself with :func:`recommended_env` (malloc
    thresholds must be set before it starts) unless ``--no-reexec``."""
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.runtime_overhead",
                                 description=H.doc_summary(__doc__))
    ap.add_argument("--ops", type=int, default=500, help="ops in the tiny graph (even)")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--zoo", default="lstm", help="zoo model for the sequential comparison ('' to skip)")
    ap.add_argument("--zoo-rounds", type=int, default=20)
    ap.add_argument("--out", default=str(H.DEFAULT_OUT))
    ap.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a measurement")
    ap.add_argument("--no-reexec", action="store_true", help="do not restart with the recommended malloc env")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if not args.no_reexec:
        _reexec_with_env(raw)
    if args.quick:
        args.rounds, args.warmup, args.zoo_rounds = 8, 2, 3

    import torch

    from opsched.backends.torch_cpu import TorchCPUBackend, recommended_env
    from opsched.importers.torch_fx import from_torch
    from opsched.machine import Machine
    from opsched.plan import uniform_plan

    machine = Machine.probe()
    cores = machine.cpu.cores
    backend = TorchCPUBackend(machine)
    unpinned = TorchCPUBackend(machine, pin=False)
    results: dict[str, Any] = {
        "target_us_per_op": TARGET_US,
        "machine": {"name": machine.name, "cpu_cores": cores, "torch": torch.__version__},
        "host": host_record(),
        "env": {k: os.environ.get(k) for k in recommended_env()},
        "command": " ".join(["python -m opsched.benchmarks.runtime_overhead", *raw]),
    }

    # ---------------------------------------------------------- tiny graph
    module, inputs = tiny_tree_module(args.ops)
    g = from_torch(module, inputs, name=f"tiny-tree-{args.ops}")
    n = len(g.ops)
    src = g.source
    seq = chain_plan(g, machine, 1, "sequential-1t")
    in_order = {op.id: float(n - i) for i, op in enumerate(g.ops)}  # graph order first, as node-by-node
    inline = uniform_plan(g, machine, cores, priority=in_order, policy="inline-all")
    corun = uniform_plan(g, machine, 1, priority=in_order, policy="corun-1t")
    ref = src.run_node_by_node(*inputs)
    for p in (seq, inline, corun):
        assert torch.allclose(backend.execute(g, p, inputs), ref), p.policy
    configs = {
        "node-by-node@1": at_threads(1, lambda: src.run_node_by_node(*inputs)),
        "sequential-1t execute": lambda: backend.execute(g, seq, inputs),
        "sequential-1t run": lambda: backend.run(g, seq, inputs),
        "sequential-1t execute unpinned": lambda: unpinned.execute(g, seq, inputs),
        "sequential-1t run unpinned": lambda: unpinned.run(g, seq, inputs),
        "node-by-node@all": at_threads(cores, lambda: src.run_node_by_node(*inputs)),
        "inline-all execute": lambda: backend.execute(g, inline, inputs),
        "inline-all run": lambda: backend.run(g, inline, inputs),
        "corun-1t execute": lambda: backend.execute(g, corun, inputs),
    }
    baseline_of = {"sequential-1t execute": "node-by-node@1", "sequential-1t run": "node-by-node@1",
                   "sequential-1t execute unpinned": "node-by-node@1",
                   "sequential-1t run unpinned": "node-by-node@1",
                   "inline-all execute": "node-by-node@all", "inline-all run": "node-by-node@all",
                   "corun-1t execute": "node-by-node@1"}
    print(f"tiny graph: {n} ops, width {g.width()}, {args.rounds} rounds", flush=True)
    times = measure(configs, args.rounds, args.warmup)
    results["tiny"] = {"graph": g.name, "ops": n, "width": g.width(),
                       "configs": summarize(times, baseline_of, n), "load": times[0].load_record()}

    # ------------------------------------------------------------ zoo model
    if args.zoo:
        from torch.utils._pytree import tree_leaves

        from opsched.zoo import ZOO

        zm, zin = ZOO[args.zoo].build(batch=1)
        zg = from_torch(zm, zin, name=args.zoo)
        zsrc = zg.source
        zseq = chain_plan(zg, machine, 1, "sequential-1t")
        zref = zsrc.run_node_by_node(*zin)
        zout = backend.execute(zg, zseq, zin)
        ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                 for a, b in zip(tree_leaves(zout), tree_leaves(zref)))
        zconf = {
            "node-by-node@1": at_threads(1, lambda: zsrc.run_node_by_node(*zin)),
            "sequential-1t execute": lambda: backend.execute(zg, zseq, zin),
            "sequential-1t run": lambda: backend.run(zg, zseq, zin),
            "sequential-1t execute unpinned": lambda: unpinned.execute(zg, zseq, zin),
        }
        print(f"zoo {args.zoo}: {len(zg.ops)} ops, {args.zoo_rounds} rounds", flush=True)
        ztimes = measure(zconf, args.zoo_rounds, max(2, args.warmup // 3))
        results["zoo"] = {"model": args.zoo, "ops": len(zg.ops), "outputs_allclose": ok,
                          "configs": summarize(ztimes, {k: "node-by-node@1" for k in zconf if "sequential" in k},
                                               len(zg.ops))}
    backend.close()
    unpinned.close()

    rows = results["tiny"]["configs"]
    head = {key: rows[name]["overhead_us_per_op"] for key, name in (
        ("execute", "sequential-1t execute"), ("run", "sequential-1t run"),
        ("execute_unpinned", "sequential-1t execute unpinned"), ("run_unpinned", "sequential-1t run unpinned"))}
    results["headline"] = {
        "overhead_us_per_op": head,
        "cpu_overhead_us_per_op": {"execute": rows["sequential-1t execute"]["cpu_overhead_us_per_op"],
                                   "run": rows["sequential-1t run"]["cpu_overhead_us_per_op"]},
        "meets_target_pinned": max(head["execute"], head["run"]) <= TARGET_US,
        "meets_target_unpinned": max(head["execute_unpinned"], head["run_unpinned"]) <= TARGET_US,
        "quick": args.quick,
    }
    H.save_result(Path(args.out), "runtime_overhead", results, _markdown(results))
    print(_markdown(results))


def _markdown(res: dict[str, Any]) -> str:
    h = res["headline"]
    lines = [
        "# TorchCPUBackend runtime overhead",
        "",
        f"`{res['command']}` on {res['machine']['cpu_cores']} cores, torch {res['machine']['torch']}, "
        f"malloc env {res['env']}, load average at start {res['host']['loadavg']}"
        + (" (QUICK smoke run)" if h["quick"] else ""),
        "",
        f"**Headline** ({res['tiny']['ops']}-op tiny graph, sequential 1-thread plan on executor threads, "
        f"median wall-time overhead over node-by-node): pinned (default) "
        f"{h['overhead_us_per_op']['execute']:.2f} us/op `execute`, {h['overhead_us_per_op']['run']:.2f} us/op "
        f"`run` (with the Trace) - target <= {res['target_us_per_op']} us/op "
        f"{'met' if h['meets_target_pinned'] else 'NOT met'}; unpinned "
        f"{h['overhead_us_per_op']['execute_unpinned']:.2f} / {h['overhead_us_per_op']['run_unpinned']:.2f} us/op "
        f"- {'met' if h['meets_target_unpinned'] else 'NOT met'}.  Process CPU time overhead (pinned): "
        f"{h['cpu_overhead_us_per_op']['execute']:.2f} / {h['cpu_overhead_us_per_op']['run']:.2f} us/op.",
        "",
        "A pinned executor thread cannot leave its core: on a shared machine whose load exceeds its cores, it "
        "waits behind other processes there while the unpinned node-by-node runner migrates - compare the "
        "pinned and unpinned rows and the load average above.",
        "",
    ]
    sections = [("tiny", f"Tiny graph ({res['tiny']['ops']} ops, width {res['tiny']['width']})")]
    if "zoo" in res:
        sections.append(("zoo", f"Zoo model {res['zoo']['model']} ({res['zoo']['ops']} ops, outputs allclose: "
                                f"{res['zoo']['outputs_allclose']})"))
    for key, title in sections:
        lines += [f"## {title}", "",
                  "| config | median ms | p10-p90 ms | overhead us/op | ratio | CPU ms | CPU overhead us/op |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, row in res[key]["configs"].items():
            ov = f"{row['overhead_us_per_op']:.2f}" if "overhead_us_per_op" in row else "(baseline)"
            ratio = f"{row['ratio_vs_baseline']:.3f}" if "ratio_vs_baseline" in row else ""
            cov = f"{row['cpu_overhead_us_per_op']:.2f}" if "cpu_overhead_us_per_op" in row else ""
            lines.append(f"| {name} | {row['median_ms']:.3f} | {row['p10_ms']:.3f}-{row['p90_ms']:.3f} "
                         f"| {ov} | {ratio} | {row['cpu_median_ms']:.3f} | {cov} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
