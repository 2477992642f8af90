"""Planning speed of the exported (numpy-only) learned scheduler, by graph size.

Target (issue 7): producing the Plan for a 200-op graph takes at most 50 ms on
one core, so planning is negligible next to a run.  Decision: the target is
checked on the *median* 200-op case (3 synthetic families x 4 machine
presets), a typical graph; the worst case is reported beside it and says
whether every case met it (``met_worst``).  The slow cases are random DAGs
planned for the big presets: there the policy waits for completions about as
often as it starts ops, so a 128-slot graph takes ~255 decisions instead of
128, and each decision re-embeds the changed ops' neighbourhood.

For every size (50, 100, 200, 400 ops) x synthetic family x machine preset,
``policy.plan(graph, machine)`` is timed end to end -- time table (analytic
model), coarsening to the policy's ``max_nodes``, every decision of the greedy
episode, the Plan -- on a *fresh copy* of the graph each time (nothing cached
from the previous repeat), after one warm-up, ``--repeats`` times; the figure
is the median.  The process is pinned to one CPU and numpy's BLAS to one
thread.  Both wall-clock and CPU time (``time.process_time``) are reported: on
a shared machine the wall clock also counts time other processes took from
the core, the CPU time only ours; the target is checked on the CPU time and
the load average is recorded.  ``--zoo`` adds the zoo models at batch 1.

    python bench/plan_speed.py                      # the shipped policy -> runs/bench/plan_speed.{json,md}
    python bench/plan_speed.py --policy runs/ppo_3/policy --zoo
    python bench/plan_speed.py --quick              # fewer repeats (smoke run)
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from opsched.errors import PolicyError  # noqa: E402
from opsched.graph import OpGraph  # noqa: E402
from opsched.io import atomic_write_text  # noqa: E402
from opsched.machine import get_machine  # noqa: E402
from opsched.policies import load  # noqa: E402
from opsched.policies.exported import pretrained_path  # noqa: E402
from opsched.synthetic import generate  # noqa: E402

SIZES = (50, 100, 200, 400)
FAMILIES = ("layered", "erdos_renyi", "watts_strogatz")
MACHINES = ("xeon-8180-2s", "knl-68", "dgx1-4v100", "local")
TARGET_MS, TARGET_OPS = 50.0, 200


def pin_one_core() -> str:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    except (AttributeError, OSError) as exc:
        return f"not pinned ({exc})"


def time_plans(policy, graph: OpGraph, machine, repeats: int) -> dict:
    """Median wall / CPU milliseconds of planning fresh copies of ``graph``."""
    data = graph.to_dict()
    policy.plan(OpGraph.from_dict(data), machine)  # warm-up (imports, first-call costs)
    wall, cpu, plan = [], [], None
    for _ in range(repeats):
        g = OpGraph.from_dict(data)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = policy.plan(g, machine)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return {"wall_ms": statistics.median(wall) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3,
            "decisions": plan.meta["decisions"], "slots": plan.meta["slots"], "coarsened": plan.meta["coarsened"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, one family")
    ap.add_argument("--zoo", action="store_true", help="also plan the zoo models at batch 1 (imports torch)")
    ap.add_argument("--out", default="runs/bench", help="output folder")
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    families = FAMILIES[:1] if args.quick else FAMILIES
    pinned = pin_one_core()

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
        by_size[n] = {"median_cpu_ms": statistics.median(r["cpu_ms"] for r in sel),
                      "max_cpu_ms": max(r["cpu_ms"] for r in sel),
                      "median_wall_ms": statistics.median(r["wall_ms"] for r in sel),
                      "max_wall_ms": max(r["wall_ms"] for r in sel), "cases": len(sel)}
    at_target = by_size[TARGET_OPS]
    met = at_target["median_cpu_ms"] <= TARGET_MS
    met_worst = at_target["max_cpu_ms"] <= TARGET_MS
    result = {
        "benchmark": "plan_speed", "target": f"Plan for a {TARGET_OPS}-op graph <= {TARGET_MS:g} ms on one core",
        "met": met, "met_worst": met_worst, "policy": str(folder), "architecture": policy.meta["architecture"],
        "max_nodes": policy.max_nodes, "repeats": repeats, "pinning": pinned, "blas_threads": 1,
        "load_average": os.getloadavg(), "python": platform.python_version(), "cpu": platform.processor(),
        "by_size": by_size, "rows": rows, "zoo": zoo,
    }
    out = Path(args.out)
    atomic_write_text(out / "plan_speed.json", json.dumps(result, indent=1) + "\n")
    lines = [
        "# Planning speed of the exported learned scheduler",
        "",
        f"Target: {result['target']} -- **{'met' if met else 'NOT met'}** on the median {TARGET_OPS}-op case "
        f"({at_target['median_cpu_ms']:.1f} ms CPU); worst case {at_target['max_cpu_ms']:.1f} ms CPU "
        f"({'met' if met_worst else 'NOT met'}: random DAGs on the big presets take up to "
        f"{max((r['decisions'] for r in rows if r['ops'] == TARGET_OPS), default=0)} decisions).",
        "",
        f"Policy `{folder}` (hidden {policy.meta['architecture']['hidden']}, rounds "
        f"{policy.meta['architecture']['rounds']}, max_nodes {policy.max_nodes}); {pinned}, BLAS 1 thread; "
        f"median of {repeats} plans of fresh graph copies per case; load average "
        f"{', '.join(f'{x:.1f}' for x in result['load_average'])}.",
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
    lines += ["", "Command: `python bench/plan_speed.py" + (f" --policy {args.policy}" if args.policy else "")
              + (" --zoo" if args.zoo else "") + (" --quick" if args.quick else "") + "`", ""]
    atomic_write_text(out / "plan_speed.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
