"""What a coarsened graph of at most 200 ops gets on a machine without GPUs: LP rounding instead of local search.

The shipped policy coarsens a graph of more than 128 ops (its ``max_nodes``)
and the planning budget (:mod:`opsched.policies.budget`) charges one of 129-200
ops as the 200-op budget graph, so until issue 23's last stop it got the
default candidates and 10 local-search steps, nothing else - while on such a
graph on a CPU-only machine LP rounding or biCPA is often the best baseline.
This benchmark compares, per pair, five rules for those graphs
(``COARSE_EXTRA`` and ``COARSE_STEPS`` of the budget module, patched while
each runs and put back after):

* ``before``: the 10 steps, no extra candidate;
* ``lp`` (shipped): LP rounding as a candidate and a hint plan, paid for with
  the steps (none left of the default 10);
* ``lp, bounded``: the same, with LP rounding's plan inside the hint's bounded
  projection search (:data:`opsched.policies.hints.EXTRAS_APART` off);
* ``lp, not hinted``: LP rounding a candidate only;
* ``lp+bicpa``: LP rounding and biCPA, the same way.

On a selection set the test split never holds: the training split's graphs of
129-200 ops (resnet50 at half width, batch 1 and 8) and six synthetic graphs
of 140-200 ops with seeds no split uses, each on three CPU-only training
machines.  Per rule: the default search's and the greedy decoding's makespan
over the best of every baseline heuristic (analytic model), and the default
search's CPU ms per plan (one core, the heuristics' cache cleared, the rules
interleaved, the smaller of two timings).

    python -m opsched.benchmarks.coarse_budget            # -> runs/bench/coarse_budget.{json,md}
    python -m opsched.benchmarks.coarse_budget --quick    # 2 graphs, 1 machine each
    python -m opsched.benchmarks.coarse_budget --train-coarse  # extras apart or not, training's coarsened graphs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import geomean, host_record

#: The rules compared: COARSE_EXTRA under each name (the steps they cost follow from it).
RULES: dict[str, tuple[str, ...]] = {"before": (), "lp": ("lp-rounding",), "lp, bounded": ("lp-rounding",),
                                     "lp, not hinted": ("lp-rounding",), "lp+bicpa": ("lp-rounding", "bicpa")}
#: Synthetic graphs of the selection set: family, ops, seed (seeds 4101-4106: no split uses them).
SYNTHETIC: tuple[tuple[str, int, int], ...] = (
    ("erdos_renyi", 150, 4101), ("layered", 170, 4102), ("watts_strogatz", 190, 4103),
    ("erdos_renyi", 200, 4104), ("layered", 140, 4105), ("watts_strogatz", 160, 4106))


@contextlib.contextmanager
def rule(name: str) -> Iterator[None]:
    """The budget module with the rule ``name`` in force inside the block."""
    from opsched.benchmarks.rejected import patched
    from opsched.policies import budget as B
    from opsched.policies import hints

    extra = RULES[name]
    steps = B.coarse_steps(extra)
    with patched(B, "COARSE_EXTRA", extra), patched(B, "COARSE_STEPS", steps), \
            patched(B, "COARSE_HINT", not name.endswith("not hinted")), \
            patched(hints, "EXTRAS_APART", not name.endswith("bounded")):
        yield


def pairs(quick: bool = False) -> list[tuple[str, str]]:
    """The selection set's (graph, machine) pairs."""
    from opsched.agents import splits
    from opsched.specs import load_graph, load_machine

    cpu = [m for m in splits.TRAIN_MACHINES if not load_machine(m).gpus]
    graphs = [g for g in splits.TRAIN_GRAPHS if 128 < len(load_graph(g).ops) <= 200]
    graphs += [f"{f}:{n}:{s}" for f, n, s in SYNTHETIC]
    if quick:
        graphs = graphs[:2]
    out = []
    for k, g in enumerate(graphs):
        machines = (cpu[k % len(cpu)], cpu[(5 * k + 3) % len(cpu)], cpu[(11 * k + 7) % len(cpu)])
        out += [(g, m) for m in dict.fromkeys(machines[:1] if quick else machines)]
    return out


def run(policy: Any, quick: bool = False) -> dict[str, Any]:
    """Every pair under every rule (see the module docstring)."""
    from opsched.benchmarks.harness import one_core, score_with_greedy, timed_plan
    from opsched.engine.sim import Simulator
    from opsched.policies.hints import clear_cache, heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    with one_core() as pinned:
        for gspec, mspec in pairs(quick):
            g, m = load_graph(gspec), load_machine(mspec)
            every = heuristic_plans(g, m, None, names(BASELINE))
            best = min(span for _, span in every.values())
            sim = Simulator(m)
            row: dict[str, Any] = {"graph": gspec, "machine": mspec, "ops": len(g.ops),
                                   "best_heuristic": min(every, key=lambda k: every[k][1])}
            order = list(RULES)
            for rep in range(2):
                for name in (order if rep == 0 else order[::-1]):
                    with rule(name):
                        plan = timed_plan(policy, g, m, row, name)
                        if rep == 0:
                            score_with_greedy(policy, g, m, sim, best, row, name, plan)
                            row[f"{name}_steps"] = plan.meta["refine_steps"]
            rows.append(row)
            print(f"{gspec} on {mspec}: " + ", ".join(f"{k} {row[f'{k}_default']:.4f}" for k in RULES), flush=True)
    clear_cache()
    summary = {name: {"default": geomean(r[f"{name}_default"] for r in rows),
                      "greedy": geomean(r[f"{name}_greedy"] for r in rows),
                      "greedy_worst": max(r[f"{name}_greedy"] for r in rows),
                      "default_worst": max(r[f"{name}_default"] for r in rows),
                      "ms_median": statistics.median(min(r[f"{name}_ms"]) for r in rows)} for name in RULES}
    return {"rows": rows, "summary": summary, "pinned": pinned}


def run_train_coarse(policy: Any) -> dict[str, Any]:
    """The greedy decoding on the training split's coarsened graphs (all of more than 128 ops,
    most of more than 200, where the budget's extras are biCPA and LP rounding) on six training
    machines (:func:`opsched.benchmarks.hint_choice.pairs_of`, ``train-coarse``), with the
    budget's extra plans inside the hint's bounded search and kept apart."""
    from opsched.benchmarks.hint_choice import pairs_of
    from opsched.benchmarks.rejected import patched
    from opsched.engine.sim import Simulator
    from opsched.policies import hints
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    for _, gspec, mspec in pairs_of("train-coarse", None, policy.max_nodes):
        g, m = load_graph(gspec), load_machine(mspec)
        best = min(span for _, span in heuristic_plans(g, m, None, names(BASELINE)).values())
        sim = Simulator(m)
        row: dict[str, Any] = {"graph": gspec, "machine": mspec, "ops": len(g.ops)}
        for tag, apart in (("bounded", False), ("apart", True)):
            with patched(hints, "EXTRAS_APART", apart):
                greedy = policy.plan(g, m, samples=0, candidates=(), refine=0)
            row[f"{tag}_greedy"] = sim.makespan(g, greedy) / best
            row[f"{tag}_hint"] = greedy.meta.get("hint")
        rows.append(row)
    summary = {tag: {"greedy": geomean(r[f"{tag}_greedy"] for r in rows),
                     "greedy_worst": max(r[f"{tag}_greedy"] for r in rows)} for tag in ("bounded", "apart")}
    return {"rows": rows, "summary": summary,
            "hints_changed": sum(r["bounded_hint"] != r["apart_hint"] for r in rows)}


def write_markdown(res: dict[str, Any], path: Path) -> None:
    lines = ["# A coarsened graph of at most 200 ops without GPUs: which extra candidates", "",
             f"`{res['command']}` on {res['host']['host']} ({res['host']['cpu_count']} CPUs), load average "
             f"{res['load_start']} -> {res['load_end']}; {res['seconds']:.0f} s; {len(res['rows'])} pairs the test "
             "split never holds.  See the docstring of `opsched.benchmarks.coarse_budget`.", "",
             "Makespan / best baseline heuristic's (geometric mean, worst); CPU ms per default plan (median).", "",
             "| rule | default | default worst | greedy | greedy worst | ms |", "|---|---:|---:|---:|---:|---:|"]
    for name, s in res["summary"].items():
        lines.append(f"| {name} | {s['default']:.4f} | {s['default_worst']:.3f} | {s['greedy']:.4f} | "
                     f"{s['greedy_worst']:.3f} | {s['ms_median']:.1f} |")
    lines += ["", "| graph | machine | ops | best heuristic | " + " | ".join(f"{k}: default / greedy (hint)" for k in RULES)
              + " |", "|---|---|---:|---|" + "---:|" * len(RULES)]
    for r in res["rows"]:
        lines.append(f"| {r['graph']} | {r['machine']} | {r['ops']} | {r['best_heuristic']} | " + " | ".join(
            f"{r[f'{k}_default']:.4f} / {r[f'{k}_greedy']:.4f} ({r[f'{k}_hint']})" for k in RULES) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.coarse_budget", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--quick", action="store_true", help="two graphs on one machine each")
    ap.add_argument("--train-coarse", action="store_true",
                    help="instead: the extras inside or apart from the hint's bounded search on the training "
                         "split's coarsened graphs (-> coarse_budget_train.json)")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT), help="output folder (default runs/bench)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    from opsched.policies.exported import load, pretrained_path

    policy = load(args.policy or pretrained_path())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0, t0 = os.getloadavg(), time.perf_counter()
    res = run_train_coarse(policy) if args.train_coarse else run(policy, args.quick)
    res.update(command=" ".join(["python -m opsched.benchmarks.coarse_budget", *argv]), host=host_record(),
               load_start=[round(x, 2) for x in load0], load_end=[round(x, 2) for x in os.getloadavg()],
               seconds=time.perf_counter() - t0, policy=str(policy.folder))
    if args.train_coarse:
        (out / "coarse_budget_train.json").write_text(json.dumps(res, indent=1, default=str))
        for tag, v in res["summary"].items():
            print(f"{tag}: greedy {v['greedy']:.4f} (worst {v['greedy_worst']:.3f})")
        print(f"hints changed: {res['hints_changed']} of {len(res['rows'])}; wrote {out / 'coarse_budget_train.json'}")
        return 0
    (out / "coarse_budget.json").write_text(json.dumps(res, indent=1, default=str))
    write_markdown(res, out / "coarse_budget.md")
    print(f"wrote {out / 'coarse_budget.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
