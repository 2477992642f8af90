"""Which plan the greedy decoding is hinted with: the policy alone, on validation or the test split.

Per pair, the shipped policy's greedy decoding (no candidates, no local
search, the plan-time prior scale) with four hints, each divided by the best
of every baseline heuristic's makespan for that pair (under the planning
model a user has there: analytic on presets, profiled on ``local``):

* ``orig``: the hint heuristic whose plan is fastest on the original graph
  (what training and the scheduler used before ``slot``);
* ``proj``: the hint heuristic whose plan, projected onto the episode's
  (possibly coarsened) slots, is fastest in the coarse replay;
* ``slot``: the hint heuristic whose projection, expanded back and simulated
  on the original graph, is fastest (:func:`opsched.policies.hints.slot_hint`:
  what training and the shipped scheduler use now);
* ``orig+cpa`` / ``proj+cpa`` / ``slot+cpa``: the same with CPA's plan among
  the hints (the same figures for a policy whose hints hold CPA already, as
  the shipped one's do);
* ``orig+budget`` / ``proj+budget`` / ``slot+budget``: the same with the
  heuristics the default search adds for the graph among the hints
  (:func:`opsched.policies.budget.hint_extra`: LP rounding on a small graph,
  biCPA and LP rounding on a large one without GPUs); ``slot+budget`` is what
  a policy exported with ``hint_budget`` (the shipped one) plans with.

Measured (issue 23, docs/learning.md): with the old hint set, CPA helped the
CPU presets and hurt the training steps, because on a coarsened graph the
fastest plan is not the one the greedy decoding can follow; ``slot`` chooses
the one it can, and the shipped policy was retrained with CPA and ``slot``.
The budget's heuristics among the hints then took the greedy decoding from
1.0157 to 1.0109 on validation and from 1.0341 to 1.0156 on the training
split's coarsened graphs (``slot`` -> ``slot+budget``).

    python -m opsched.benchmarks.hint_choice --split val            # -> runs/bench/hint_choice_val.json
    python -m opsched.benchmarks.hint_choice --split test --group step
    python -m opsched.benchmarks.hint_choice --split train-coarse   # training graphs of > 128 ops
    python -m opsched.benchmarks.hint_choice --cost                 # slot_hint's planning time
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsched.timing import geomean

VARIANTS = ("orig", "proj", "slot", "orig+cpa", "proj+cpa", "slot+cpa", "orig+budget", "proj+budget", "slot+budget")


#: Training machines the ``train-coarse`` selection set runs its graphs on.
COARSE_MACHINES = 6


def pairs_of(split: str, group: str | None, max_nodes: int = 128) -> list[tuple[str, str, str]]:
    """(group, graph spec, machine spec) of the split, optionally one group of the test split.
    ``train-coarse``: the training split's graphs of more than ``max_nodes`` ops (the ones the
    policy coarsens) on its first :data:`COARSE_MACHINES` machines, a selection set for the
    hint of coarsened graphs that the test split never holds (validation has few such graphs)."""
    from opsched.agents import splits
    from opsched.benchmarks.learned import test_pairs
    from opsched.benchmarks.plan_search import validation_pairs
    from opsched.specs import load_graph

    if split == "test":
        pairs = test_pairs()
    elif split == "train-coarse":
        big = [g for g in splits.TRAIN_GRAPHS if len(load_graph(g).ops) > max_nodes]
        pairs = [("train-coarse", g, m) for g in big for m in splits.TRAIN_MACHINES[:COARSE_MACHINES]]
    else:
        pairs = [("validation", g, m) for g, m in validation_pairs()]
    return [p for p in pairs if group is None or p[0] == group]


def greedy_ratios(policy: Any, pairs: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """One row per pair: each variant's greedy makespan over the best baseline's."""
    from opsched.backends.sim import SimBackend
    from opsched.benchmarks.learned import planning_model_for
    from opsched.engine.observe import prepare_episode
    from opsched.engine.slots import from_plan, makespan
    from opsched.policies.budget import hint_extra
    from opsched.policies.exported import decode
    from opsched.policies.hints import HintPlans, heuristic_plans, slot_hint
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
        extra = hint_extra(len(graph.ops), policy.max_nodes, bool(machine.gpus))
        for tag, hints in (("", tuple(policy.hints)), ("+cpa", (*policy.hints, "cpa")),
                           ("+budget", (*policy.hints, *extra))):
            heur = HintPlans({name: every[name] for name in dict.fromkeys(hints)})  # each planned once per pair
            if tag == "+budget":  # as the scheduler's episode_heuristics: the extras projected apart
                heur.extra = tuple(x for x in dict.fromkeys(extra) if x not in policy.hints)
            chosen = {"orig": min(heur, key=lambda k: heur[k][1]),
                      "proj": min(heur, key=lambda k: makespan(bare, from_plan(bare, heur[k][0]))),
                      "slot": slot_hint(bare, heur, model)[0]}
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


#: The 200-op planning cases of the planning-time target (those of ``bench/learned.py``).
COST_CASES = tuple((g, m) for g in ("layered:200:911", "erdos_renyi:200:912", "watts_strogatz:200:913")
                   for m in ("knl-68", "dgx1-4v100"))


def hint_cost(policy: Any, repeats: int = 7, cases: Sequence[tuple[str, str]] | None = None) -> dict[str, Any]:
    """What :func:`~opsched.policies.hints.slot_hint` costs at plan time: median CPU ms of
    the default search per case with it and with the fastest plan as the hint instead,
    the two interleaved (alternating which goes first) in one process on one core, the
    heuristics' cache cleared before each plan (they are part of its cost)."""
    import os
    import statistics

    from opsched.benchmarks.harness import pin_one_core
    from opsched.machine import get_machine
    from opsched.policies import hints
    from opsched.specs import load_graph

    def fastest(data: Any, plans: Any, model: Any = None) -> tuple[str, Any]:
        name = min(plans, key=lambda k: plans[k][1])
        return name, plans[name][0]

    rules = {"slot_hint": hints.slot_hint, "fastest": fastest}
    pinned, load0, out = pin_one_core(), os.getloadavg(), {}
    try:
        for gspec, mspec in COST_CASES if cases is None else cases:
            g, m = load_graph(gspec), get_machine(mspec)
            policy.plan(g, m)  # warm: time tables
            ts: dict[str, list[float]] = {k: [] for k in rules}
            for r in range(repeats):
                for tag in (list(rules) if r % 2 else list(rules)[::-1]):
                    hints.slot_hint = rules[tag]
                    hints.clear_cache()
                    t0 = time.process_time()
                    policy.plan(g, m, seed=r)
                    ts[tag].append(time.process_time() - t0)
            out[f"{gspec}@{mspec}"] = {k: 1e3 * statistics.median(v) for k, v in ts.items()}
    finally:
        hints.slot_hint = rules["slot_hint"]
    med = {k: statistics.median(c[k] for c in out.values()) for k in rules}
    return {"cases": out, "median_ms": med, "ratio": med["slot_hint"] / med["fastest"], "repeats": repeats,
            "pinned": pinned, "load_start": load0, "load_end": os.getloadavg()}


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.hint_choice",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--split", choices=("val", "test", "train-coarse"), default="val",
                    help="validation, the test split, or the training split's coarsened graphs")
    ap.add_argument("--group", default=None, help="test split only: cpu, gpu, local, placement or step")
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--cost", action="store_true",
                    help="instead: planning time of a 200-op graph with and without slot_hint -> hint_cost.json")
    args = ap.parse_args(argv)
    policy = load(args.policy or pretrained_path())
    if args.cost:
        cost = hint_cost(policy)
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "hint_cost.json", json.dumps({"policy": str(policy.folder), **cost}, indent=1) + "\n")
        print(f"median ms: slot_hint {cost['median_ms']['slot_hint']:.1f}, fastest plan as hint "
              f"{cost['median_ms']['fastest']:.1f} (x{cost['ratio']:.3f}) -> {args.out / 'hint_cost.json'}")
        return 0
    t0 = time.perf_counter()
    rows = greedy_ratios(policy, pairs_of(args.split, args.group, policy.max_nodes))
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
