"""The greedy decoding's dispatch order: the episode's, the hint plan's, or the faster of the two.

Per pair, the shipped policy's greedy decoding (no candidates, no local
search, the plan-time prior scale), its makespan divided by the best of
every baseline heuristic's (under the planning model a user has there), with
the decoded devices and thread counts dispatched in

* ``episode``: the episode's own order and holds (the scheduler before this
  benchmark: on a coarsened graph, whole groups in the order the policy
  started them);
* ``hint``: the hint plan's priorities and holds
  (:func:`opsched.engine.slots.in_hint_order`);
* ``faster``: the faster of the two, simulated on the original graph
  (:func:`opsched.engine.slots.faster_order`: what the shipped scheduler and
  training's validation use).

Measured (issue 23, docs/learning.md, the selection sets first): validation
1.0109 -> 1.0109, the training split's coarsened graphs 1.0128 -> 1.0090
(``episode`` -> ``faster``), so ``faster`` was adopted; the test split then
1.0030 -> 0.9990, worst pair 1.110 -> 1.063.

    python -m opsched.benchmarks.greedy_order --split val            # -> runs/bench/greedy_order_val.json
    python -m opsched.benchmarks.greedy_order --split train-coarse   # training graphs of > 128 ops
    python -m opsched.benchmarks.greedy_order --split test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opsched.timing import geomean

VARIANTS = ("episode", "hint", "faster")


@contextlib.contextmanager
def order_variant(name: str) -> Iterator[None]:
    """:func:`opsched.engine.slots.episode_plan` dispatching in the ``name`` order (:data:`VARIANTS`)."""
    from opsched.engine import slots

    if name not in VARIANTS:
        raise ValueError(f"order_variant: unknown variant {name!r}; choose one of {', '.join(VARIANTS)}")
    shipped = slots.faster_order
    choose = {"episode": lambda data, plan, hint: plan,
              "hint": lambda data, plan, hint: slots.in_hint_order(plan, hint),
              "faster": shipped}[name]
    slots.faster_order = choose
    try:
        yield
    finally:
        slots.faster_order = shipped


def order_ratios(policy: Any, pairs: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """One row per (group, graph, machine): each variant's greedy makespan over the best baseline's."""
    from opsched.backends.sim import SimBackend
    from opsched.benchmarks.learned import planning_model_for
    from opsched.policies.hints import best_heuristic
    from opsched.policies.registry import BASELINE, names
    from opsched.specs import load_graph, load_machine

    rows = []
    for group, gspec, mspec in pairs:
        graph, machine = load_graph(gspec), load_machine(mspec)
        if mspec == "local":
            machine = machine.cpu_only()
        model = planning_model_for(mspec, machine)
        best = best_heuristic(graph, machine, model, names(BASELINE))[2]
        sim = SimBackend(machine, model)
        row: dict[str, Any] = {"group": group, "graph": gspec, "machine": mspec}
        for v in VARIANTS:
            with order_variant(v):
                plan = policy.plan(graph, machine, model, samples=0, candidates=(), refine=0)
            row[v] = float(sim.run(graph, plan).makespan) / best
            if v == "faster":
                row["order"] = plan.meta.get("order")
        rows.append(row)
    return rows


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each variant's geometric mean and worst ratio, and how many pairs it changed from ``episode``."""
    out: dict[str, Any] = {"pairs": len(rows)}
    for v in VARIANTS:
        xs = [r[v] for r in rows]
        out[v] = {"gmean": geomean(xs) if xs else float("nan"), "worst": max(xs, default=float("nan")),
                  "better": sum(r[v] < r["episode"] * (1 - 1e-9) for r in rows),
                  "worse": sum(r[v] > r["episode"] * (1 + 1e-9) for r in rows)}
    return out


def write_markdown(res: dict[str, Any], path: Path) -> None:
    """The summary and the pairs a variant changed, as a table."""
    from opsched.io import atomic_write_text

    s = res["summary"]
    lines = [f"# Greedy decoding's dispatch order, split `{res['split']}` ({s['pairs']} pairs)", "",
             f"Greedy makespan over the best baseline heuristic's; {res['seconds']:.0f} s, load "
             f"{res['load'][0]:.2f} -> {res['load'][1]:.2f}. "
             "`python -m opsched.benchmarks.greedy_order --split " + res["split"] + "`", "",
             "| order | geometric mean | worst | better than episode | worse |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {v} | {s[v]['gmean']:.4f} | {s[v]['worst']:.3f} | {s[v]['better']} | {s[v]['worse']} |"
              for v in VARIANTS]
    changed = [r for r in res["rows"] if any(abs(r[v] - r["episode"]) > 1e-9 * r["episode"] for v in VARIANTS)]
    lines += ["", "Pairs where a variant differs from `episode`:", "",
              "| group | graph | machine | episode | hint | faster |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['group']} | {r['graph']} | {r['machine']} | {r['episode']:.4f} | {r['hint']:.4f} | "
              f"{r['faster']:.4f} |" for r in sorted(changed, key=lambda r: -r["episode"])]
    atomic_write_text(path, "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.benchmarks.hint_choice import pairs_of
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.greedy_order",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--split", choices=("val", "test", "train-coarse"), default="val",
                    help="validation, the test split, or the training split's coarsened graphs")
    ap.add_argument("--group", default=None, help="test split only: cpu, gpu, local, placement or step")
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args(argv)
    policy = load(args.policy or pretrained_path())
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    rows = order_ratios(policy, pairs_of(args.split, args.group, policy.max_nodes))
    res = {"split": args.split, "group": args.group, "policy": str(policy.folder), "rows": rows,
           "summary": summarise(rows), "seconds": time.perf_counter() - t0, "load": [load0, os.getloadavg()[0]]}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"greedy_order_{args.split}" + (f"_{args.group}" if args.group else "")
    atomic_write_text(args.out / f"{name}.json", json.dumps(res, indent=1) + "\n")
    write_markdown(res, args.out / f"{name}.md")
    for v in VARIANTS:
        s = res["summary"][v]
        print(f"{v}: {s['gmean']:.4f} (worst {s['worst']:.3f}; better {s['better']}, worse {s['worse']})")
    print(f"-> {args.out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
