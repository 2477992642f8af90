"""biCPA as a free candidate of the default search on small graphs, against the search without it.

The shipped budget (:mod:`opsched.policies.budget`) adds biCPA
(:data:`~opsched.policies.budget.BUDGET_FREE_EXTRA`) to a graph below the
budget graph's size where its cost fits the spare budget, on top of LP
rounding and the local-search steps rather than paid for with them; its plan joins the
budget hint too (:func:`~opsched.policies.budget.hint_extra`).  This
benchmark plans the selection sets of ``python -m opsched.benchmarks.rejected
--what bicpa`` (the validation split's graphs of at most 128 ops, the hard
families' training pairs, the training split's synthetic graphs on two
training machines each: nothing the test split holds) with and without it,
per plan seed: the default search's and the greedy decoding's makespan over
the best of every baseline heuristic, and CPU ms per default plan (the two
interleaved, the heuristics' cache cleared before each).

    python -m opsched.benchmarks.budget_free --seeds 3 --out docs/bench
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

import numpy as np

from opsched.timing import geomean

VARIANTS = ("without", "shipped")


@contextlib.contextmanager
def free_extra(on: bool) -> Iterator[None]:
    """The planner with (``on``, as shipped) or without biCPA as the budget's free extra."""
    from opsched.benchmarks.rejected import patched
    from opsched.policies import budget

    if on:
        yield
        return
    with patched(budget, "BUDGET_FREE_EXTRA", ""):
        yield


def run(policy: Any, seeds: Sequence[int], quick: bool = False) -> dict[str, Any]:
    """Per pair and plan seed, each variant's default and greedy makespan over the best baseline's."""
    from opsched.benchmarks.harness import timed_plan
    from opsched.benchmarks.rejected import bicpa_set_pairs
    from opsched.policies.hints import clear_cache

    rows = []
    for g, m, sim, best, row in bicpa_set_pairs(policy, quick):
        for k, seed in enumerate(seeds):
            for tag in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
                with free_extra(tag == "shipped"):
                    plan = timed_plan(policy, g, m, row, tag, seed=seed)
                    row.setdefault(f"{tag}_default", []).append(sim.makespan(g, plan) / best)
                    if k == 0:  # the greedy decoding does not depend on the plan seed
                        greedy = policy.plan(g, m, samples=0, candidates=(), refine=0)
                        row[f"{tag}_greedy"] = sim.makespan(g, greedy) / best
                        row[f"{tag}_bicpa"] = "heuristic:bicpa" in plan.meta["candidates"]
        rows.append(row)
    clear_cache()
    return {"seeds": list(seeds), "rows": rows, "summary": summarise(rows, len(seeds))}


def summarise(rows: Sequence[dict[str, Any]], n_seeds: int) -> dict[str, Any]:
    """Per set: each variant's geometric mean per seed, the greedy's, the pairs changed, and median ms."""
    out: dict[str, Any] = {}
    for set_name in dict.fromkeys(r["set"] for r in rows):
        sel = [r for r in rows if r["set"] == set_name]
        s: dict[str, Any] = {"pairs": len(sel), "with_bicpa": sum(r["shipped_bicpa"] for r in sel)}
        for tag in VARIANTS:
            s[f"{tag}_default"] = [geomean(r[f"{tag}_default"][k] for r in sel) for k in range(n_seeds)]
            s[f"{tag}_greedy"] = geomean(r[f"{tag}_greedy"] for r in sel)
            s[f"{tag}_ms_median"] = float(np.median([np.median(r[f"{tag}_ms"]) for r in sel]))
        pairs = [(r["without_default"][k], r["shipped_default"][k]) for r in sel for k in range(n_seeds)]
        s["default_better"] = sum(b < a * (1 - 1e-9) for a, b in pairs)
        s["default_worse"] = sum(b > a * (1 + 1e-9) for a, b in pairs)
        s["greedy_better"] = sum(r["shipped_greedy"] < r["without_greedy"] * (1 - 1e-9) for r in sel)
        s["greedy_worse"] = sum(r["shipped_greedy"] > r["without_greedy"] * (1 + 1e-9) for r in sel)
        out[set_name] = s
    return out


def write_markdown(res: dict[str, Any], path: Path) -> None:
    from opsched.io import atomic_write_text

    lines = ["# biCPA as a free candidate of the default search (small graphs)", "",
             f"`python -m opsched.benchmarks.budget_free --seeds {len(res['seeds'])}`; {res['seconds']:.0f} s, "
             f"load {res['load'][0]:.2f} -> {res['load'][1]:.2f}.  Makespan over the best baseline heuristic's, "
             "geometric mean (the default search per plan seed); *changed*: (pair, seed) cases better / worse "
             "with it; CPU ms per default plan, median.  Selection sets only (no test pair).", "",
             "| set | pairs | get biCPA | default without | default shipped | changed | greedy without | "
             "greedy shipped | greedy changed | ms without | ms shipped |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in res["summary"].items():
        lines.append(
            f"| {name} | {s['pairs']} | {s['with_bicpa']} | {' / '.join(f'{x:.4f}' for x in s['without_default'])} | "
            f"{' / '.join(f'{x:.4f}' for x in s['shipped_default'])} | {s['default_better']} / {s['default_worse']} | "
            f"{s['without_greedy']:.4f} | {s['shipped_greedy']:.4f} | {s['greedy_better']} / {s['greedy_worse']} | "
            f"{s['without_ms_median']:.1f} | {s['shipped_ms_median']:.1f} |")
    worse = [(r, k) for r in res["rows"] for k in range(len(res["seeds"]))
             if r["shipped_default"][k] > r["without_default"][k] * (1 + 1e-9)]
    if worse:
        lines += ["", "Where the default search got worse:", "", "| set | graph | machine | seed | without | shipped |",
                  "|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['set']} | {r['graph']} | {r['machine']} | {res['seeds'][k]} | {r['without_default'][k]:.4f} | "
                  f"{r['shipped_default'][k]:.4f} |" for r, k in worse]
    atomic_write_text(path, "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.benchmarks.harness import doc_summary
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.budget_free",
                                 description=doc_summary(__doc__, paragraph=True))
    ap.add_argument("--seeds", type=int, default=3, help="plan seeds (0..N-1) of the default search")
    ap.add_argument("--quick", action="store_true", help="two pairs per set")
    ap.add_argument("--policy", default=None, help="exported policy folder (default: the shipped one)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    policy = load(args.policy or pretrained_path())
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    res = run(policy, range(args.seeds), args.quick)
    res.update(policy=str(policy.folder), seconds=time.perf_counter() - t0, load=[load0, os.getloadavg()[0]])
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "budget_free.json", json.dumps(res, indent=1) + "\n")
    write_markdown(res, args.out / "budget_free.md")
    for name, s in res["summary"].items():
        print(f"{name}: default {s['without_default']} -> {s['shipped_default']}, "
              f"greedy {s['without_greedy']:.4f} -> {s['shipped_greedy']:.4f}")
    print(f"-> {args.out / 'budget_free.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
