"""Which plan the greedy decoding is hinted with: the policy alone, on validation or the test split.

Per pair, the shipped policy's greedy decoding (no candidates, no local
search, the plan-time prior scale) with four hints, each divided by the best
of every baseline heuristic's makespan for that pair (under the planning
model a user has there: analytic on presets, profiled on ``local``):

* ``orig``: the hint heuristic whose plan is fastest on the original graph
  (what training and the shipped scheduler use);
* ``proj``: the hint heuristic whose plan, projected onto the episode's
  (possibly coarsened) slots, is fastest there;
* ``orig+cpa`` / ``proj+cpa``: the same with CPA's plan among the hints.

Measured (issue 23, docs/learning.md): CPA helps the CPU presets and hurts
the training steps; neither variant was adopted.

    python -m opsched.benchmarks.hint_choice --split val            # -> runs/bench/hint_choice_val.json
    python -m opsched.benchmarks.hint_choice --split test --group step
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsched.timing import geomean

VARIANTS = ("orig", "proj", "orig+cpa", "proj+cpa")


def pairs_of(split: str, group: str | None) -> list[tuple[str, str, str]]:
    """(group, graph spec, machine spec) of the split, optionally one group of the test split."""
    from opsched.benchmarks.learned import test_pairs
    from opsched.benchmarks.plan_search import validation_pairs

    pairs = test_pairs() if split == "test" else [("validation", g, m) for g, m in validation_pairs()]
    return [p for p in pairs if group is None or p[0] == group]


def greedy_ratios(policy: Any, pairs: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """One row per pair: each variant's greedy makespan over the best baseline's."""
    from opsched.backends.sim import SimBackend
    from opsched.benchmarks.learned import planning_model_for
    from opsched.engine.observe import prepare_episode
    from opsched.engine.slots import from_plan, makespan
    from opsched.policies.exported import decode
    from opsched.policies.hints import heuristic_plans
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    for group, gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        if mspec == "local":
            machine = machine.cpu_only()
        model = planning_model_for(mspec, machine)
        every = heuristic_plans(graph, machine, model, tuple(dict.fromkeys([*names(BASELINE), *policy.hints, "cpa"])))
        best = min(span for name, (_, span) in every.items() if name in names(BASELINE))
        sim = SimBackend(machine, model)
        bare = prepare_episode(graph, machine, model, policy.max_nodes, policy.max_edges, None)
        row: dict[str, Any] = {"group": group, "graph": gspec, "machine": mspec}
        for tag, hints in (("", tuple(policy.hints)), ("+cpa", (*policy.hints, "cpa"))):
            heur = {name: every[name] for name in hints}  # each heuristic planned once per pair
            chosen = {"orig": min(heur, key=lambda k: heur[k][1]),
                      "proj": min(heur, key=lambda k: makespan(bare, from_plan(bare, heur[k][0])))}
            for how, name in chosen.items():
                data = prepare_episode(graph, machine, model, policy.max_nodes, policy.max_edges, heur[name][0])
                row[how + tag] = float(sim.run(graph, decode(policy, data)).makespan) / best
                row[f"{how + tag}_hint"] = name
        rows.append(row)
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per group and over all rows: each variant's geometric mean and worst ratio."""
    def stats(sel: list[dict[str, Any]]) -> dict[str, Any]:
        return {v: {"gmean": geomean(r[v] for r in sel), "worst": max(r[v] for r in sel)} for v in VARIANTS}

    out = {g: stats([r for r in rows if r["group"] == g]) for g in sorted({r["group"] for r in rows})}
    out["all"] = stats(list(rows))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.hint_choice",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--split", choices=("val", "test"), default="val")
    ap.add_argument("--group", default=None, help="test split only: cpu, gpu, local, placement or step")
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args(argv)
    policy = load(args.policy or pretrained_path())
    t0 = time.perf_counter()
    rows = greedy_ratios(policy, pairs_of(args.split, args.group))
    res = {"split": args.split, "group": args.group, "policy": str(policy.folder), "rows": rows,
           "summary": summarise(rows), "seconds": time.perf_counter() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"hint_choice_{args.split}" + (f"_{args.group}" if args.group else "")
    atomic_write_text(args.out / f"{name}.json", json.dumps(res, indent=1) + "\n")
    for g, per in res["summary"].items():
        print(g, "  ".join(f"{v} {s['gmean']:.4f} (worst {s['worst']:.3f})" for v, s in per.items()))
    print(f"-> {args.out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
