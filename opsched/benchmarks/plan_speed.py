"""Planning speed of the exported (numpy-only) learned scheduler, by graph size.

Target (issue 23): the Plan for a 200-op graph in at most 100 ms on one core
with the default plan-time search (greedy decoding, the hint heuristics as
candidates, local search; issue 7's 50 ms was for greedy decoding alone), so
planning is negligible next to a run; checked on the *median* 200-op case (a
typical graph), with the worst case reported beside it (``met_worst``).

    python -m opsched.benchmarks.plan_speed          # the shipped policy -> runs/bench/plan_speed.{json,md}
    python -m opsched.benchmarks.plan_speed --policy runs/ppo_3/policy --zoo
    python -m opsched.benchmarks.plan_speed --quick  # fewer repeats (smoke run)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.graph import OpGraph
from opsched.timing import clocked, host_record, summary

SIZES = (50, 100, 200, 400)
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100", "local")
TARGET_MS, TARGET_OPS = 100.0, 200


def clocked_plans(plan: Callable[[OpGraph], Any], graph: OpGraph, repeats: int) -> Any:
    """:func:`opsched.timing.clocked` runs of ``plan`` on fresh copies of
    ``graph``, after one warm-up: before each, the hint heuristics' cache is
    cleared (they are part of planning a graph the first time) and the graph
    is copied, neither timed.  Shared with :mod:`opsched.benchmarks.plan_search`."""
    from opsched.policies.hints import clear_cache

    data = graph.to_dict()

    def fresh() -> OpGraph:
        clear_cache()
        return OpGraph.from_dict(data)

    return clocked(plan, repeats, warmup=1, setup=fresh)


def case_ms(plan: Callable[[OpGraph, Any], Any], n_ops: int, families: Sequence[str], machines: Sequence[str],
            repeats: int) -> dict[str, Any]:
    """Median CPU ms of ``plan(graph, machine)`` on each (family, machine) case of
    ``n_ops`` ops (:func:`clocked_plans`), and the median and worst over the
    cases.  Shared by :mod:`opsched.benchmarks.plan_search` and
    :mod:`opsched.benchmarks.plan_budget`."""
    import statistics

    from opsched.machine import get_machine
    from opsched.synthetic import generate

    cases = []
    for fam in families:
        for mname in machines:
            graph, machine = generate(fam, n_ops, 1000 + n_ops), get_machine(mname)
            runs = clocked_plans(lambda g, m=machine: plan(g, m), graph, repeats)
            cases.append(summary(runs.cpu_s)["median"] * 1e3)
    return {"median_ms": statistics.median(cases), "worst_ms": max(cases), "cases": cases}


def time_plans(policy: Any, graph: OpGraph, machine: Any, repeats: int) -> dict[str, Any]:
    """Median wall / CPU milliseconds of planning fresh copies of ``graph``, the
    hint heuristics included (:func:`clocked_plans`)."""
    runs = clocked_plans(lambda g: policy.plan(g, machine), graph, repeats)
    plan = runs.results[-1]
    return {"wall_ms": summary(runs.wall_s)["median"] * 1e3, "cpu_ms": summary(runs.cpu_s)["median"] * 1e3,
            **{k: plan.meta.get(k) for k in ("decisions", "slots", "coarsened", "chosen")}}


def main(argv: Sequence[str] | None = None) -> None:
    """For every size (50, 100, 200, 400 ops) x synthetic family (3) x machine
    preset (4), ``policy.plan(graph, machine)`` is timed end to end -- time table
    (analytic model), coarsening to the policy's ``max_nodes``, every decision,
    the Plan -- on a *fresh copy* of the graph each time (nothing cached from the
    previous repeat), after one warm-up, ``--repeats`` times; the figure is the
    median.  The process is pinned to one CPU and its BLAS to one thread.  Wall
    and CPU time are both reported (on a shared machine the wall clock also
    counts time other processes took from the core); the target is checked on
    the CPU time.  The slow cases are random DAGs on the big presets, where the
    policy waits for completions about as often as it starts ops.  ``--zoo``
    adds the zoo models at batch 1."""
    from opsched.benchmarks.harness import doc_summary
    from opsched.errors import PolicyError
    from opsched.machine import get_machine
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path
    from opsched.synthetic import generate

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.plan_speed", description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, one family")
    ap.add_argument("--zoo", action="store_true", help="also plan the zoo models at batch 1 (imports torch)")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    families = FAMILIES[:1] if args.quick else FAMILIES
    pinned = H.pin_one_core()

    folder = Path(args.policy) if args.policy else pretrained_path()
    policy = load(folder)
    rows = []
    for n in SIZES:
        for fam in families:
            graph = generate(fam, n, 1000 + n)
            for mname in MACHINES:
                try:
                    policy.check(graph, get_machine(mname))
                except PolicyError as exc:
                    print(f"skipped {mname}: {exc}")
                    continue
                r = time_plans(policy, graph, get_machine(mname), repeats)
                rows.append({"graph": f"{fam}:{n}", "ops": n, "machine": mname, **r})
                print(f"{fam:>15} {n:4d} ops {mname:>13}: {r['cpu_ms']:7.1f} ms CPU {r['wall_ms']:7.1f} ms wall, "
                      f"{r['decisions']} decisions on {r['slots']} slots", flush=True)
    zoo = []
    if args.zoo:
        from opsched.specs import load_graph
        from opsched.zoo import ZOO

        for name in ZOO:
            graph = load_graph(f"zoo:{name}")
            r = time_plans(policy, graph, get_machine("local"), repeats)
            zoo.append({"graph": f"zoo:{name}", "ops": len(graph.ops), "machine": "local", **r})
            print(f"zoo:{name:>12} {len(graph.ops):4d} ops: {r['cpu_ms']:7.1f} ms CPU {r['wall_ms']:7.1f} ms wall",
                  flush=True)

    by_size = {}
    for n in SIZES:
        sel = [r for r in rows if r["ops"] == n]
        by_size[n] = {"median_cpu_ms": summary(r["cpu_ms"] for r in sel)["median"],
                      "max_cpu_ms": max(r["cpu_ms"] for r in sel),
                      "median_wall_ms": summary(r["wall_ms"] for r in sel)["median"],
                      "max_wall_ms": max(r["wall_ms"] for r in sel), "cases": len(sel)}
    at_target = by_size[TARGET_OPS]
    met = at_target["median_cpu_ms"] <= TARGET_MS
    met_worst = at_target["max_cpu_ms"] <= TARGET_MS
    result = {
        "benchmark": "plan_speed", "target": f"Plan for a {TARGET_OPS}-op graph <= {TARGET_MS:g} ms on one core",
        "met": met, "met_worst": met_worst, "policy": str(folder), "architecture": policy.meta["architecture"],
        "max_nodes": policy.max_nodes, "repeats": repeats, "pinning": pinned, "blas_threads": 1,
        "host": host_record(), "by_size": by_size, "rows": rows, "zoo": zoo,
    }
    load = result["host"]["loadavg"] or ()
    lines = [
        "# Planning speed of the exported learned scheduler",
        "",
        f"Target: {result['target']} -- **{'met' if met else 'NOT met'}** on the median {TARGET_OPS}-op case "
        f"({at_target['median_cpu_ms']:.1f} ms CPU); worst case {at_target['max_cpu_ms']:.1f} ms CPU "
        f"({'met' if met_worst else 'NOT met'}: random DAGs on the big presets take up to "
        f"{max((r['decisions'] or 0 for r in rows if r['ops'] == TARGET_OPS), default=0)} decisions).",
        "",
        f"Policy `{folder}` (hidden {policy.meta['architecture']['hidden']}, rounds "
        f"{policy.meta['architecture']['rounds']}, max_nodes {policy.max_nodes}); {pinned}, BLAS 1 thread; "
        f"median of {repeats} plans of fresh graph copies per case; load average "
        f"{', '.join(f'{x:.1f}' for x in load) or 'unknown'}.",
        "",
        "| ops | cases | median CPU ms | worst CPU ms | median wall ms | worst wall ms |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {n} | {s['cases']} | {s['median_cpu_ms']:.1f} | {s['max_cpu_ms']:.1f} | {s['median_wall_ms']:.1f} | "
          f"{s['max_wall_ms']:.1f} |" for n, s in by_size.items()],
    ]
    if zoo:
        lines += ["", "| zoo graph (batch 1) | ops | slots | decisions | CPU ms | wall ms |",
                  "|---|---:|---:|---:|---:|---:|",
                  *[f"| {z['graph']} | {z['ops']} | {z['slots']} | {z['decisions']} | {z['cpu_ms']:.1f} | "
                    f"{z['wall_ms']:.1f} |" for z in zoo]]
    lines += ["", "Command: `python -m opsched.benchmarks.plan_speed" + (f" --policy {args.policy}" if args.policy
                                                                        else "")
              + (" --zoo" if args.zoo else "") + (" --quick" if args.quick else "") + "`", ""]
    H.save_result(Path(args.out), "plan_speed", result, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
