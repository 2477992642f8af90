"""The learned policy for real on this machine: every heuristic and the learned plan on the zoo, against eager.

For each zoo model at batch 1 and 8: every heuristic and the shipped learned
policy plan the model with this machine's planning model (the fitted
profiles plus the runtime model, when ``opsched profile`` made them).  The
learned policy's plan is reported twice: as the model chose it (``learned``)
and as ``opsched.apply`` chooses it by default (``learned-measured``: the
model's three best candidates timed on the runtime, :mod:`opsched.measured`;
those selection timings are separate from the rounds reported here).  Each
plan runs on opsched's PyTorch CPU runtime with its outputs checked once
against eager PyTorch, and all of them and eager are timed in interleaved
rounds in one process (:func:`opsched.timing.interleave`).  Reported: time
per inference relative to eager (median and quartiles), the learned plan
over the fastest heuristic's, and the load the rounds ran under.

``python bench/apply_zoo.py`` writes ``runs/bench/apply_zoo.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsched.benchmarks.harness import doc_summary
from opsched.policies import BASELINE, names
from opsched.timing import host_record, interleave, wall_clock

if TYPE_CHECKING:
    from opsched.policies.exported import ExportedPolicy


def measure(model_name: str, batch: int, policy: ExportedPolicy, rounds: int, warmup: int) -> dict[str, Any]:
    import torch

    from opsched.backends.torch_cpu import TorchCPUBackend
    from opsched.importers.torch_fx import from_torch
    from opsched.measured import choose_measured
    from opsched.planning import describe, planning_model
    from opsched.policies import get_policy
    from opsched.policies.exported import pick
    from opsched.scheduled import outputs_equal
    from opsched.specs import load_machine, load_torch_model

    module, inputs = load_torch_model(f"zoo:{model_name}", batch)
    graph = from_torch(module, inputs, name=model_name)
    machine = load_machine("local").cpu_only()
    model = planning_model(machine, "torch-cpu", "auto")
    plans = {name: get_policy(name).plan(graph, machine, model) for name in names(BASELINE)}
    t0 = time.perf_counter()
    found = policy.plan_candidates(graph, machine, model)
    plans["learned"] = pick(found)
    plan_s = time.perf_counter() - t0
    with TorchCPUBackend(machine) as backend, torch.no_grad():
        t0 = time.perf_counter()
        plans["learned-measured"] = choose_measured(backend, graph, found, inputs)
        measure_s = time.perf_counter() - t0
        want = module(*inputs)
        same = {k: outputs_equal(backend.execute(graph, p, inputs), want) for k, p in plans.items()}
        configs = {"eager": wall_clock(lambda: module(*inputs))}
        configs.update({k: wall_clock(lambda p=p: backend.execute(graph, p, inputs)) for k, p in plans.items()})
        timings = interleave(configs, warmup, rounds)
    ratios = timings.ratios("eager")
    rows = {k: {**timings.stats(k), "outputs_equal_eager": same.get(k, True)} for k in configs}
    fastest = min(names(BASELINE), key=timings.median)
    return {"model": model_name, "batch": batch, "ops": len(graph.ops), "perf_model": describe(model),
            "chosen": plans["learned"].meta.get("chosen"), "plan_s": plan_s, "rows": rows,
            "measured_chosen": plans["learned-measured"].meta.get("chosen"), "measure_s": measure_s,
            "ratios_to_eager": ratios, "fastest_heuristic": fastest,
            "learned_over_fastest": timings.median("learned") / timings.median(fastest),
            "learned_over_eager": timings.median("learned") / timings.median("eager"),
            "measured_over_fastest": timings.median("learned-measured") / timings.median(fastest),
            "measured_over_eager": timings.median("learned-measured") / timings.median("eager"),
            "load": timings.load_record()}


def write_markdown(res: dict[str, Any], path: Path) -> None:
    lines = ["# The learned policy for real on this machine", "",
             f"`{res['command']}` on {res['host']['host']} ({res['host']['cpu_count']} CPUs), "
             f"{res['seconds']:.0f} s. Median time per inference over {res['rounds']} interleaved rounds "
             "(each plan on opsched's PyTorch CPU runtime; outputs checked against eager).", "",
             "`learned`: the planning model's choice; `measured`: what `opsched.apply` runs by default (the model's "
             "3 best candidates timed on the runtime first, in separate rounds).", "",
             "| model | batch | eager ms | fastest heuristic | its time / eager | learned / eager | "
             "learned / fastest heuristic | measured / eager | measured / fastest heuristic | model chose | "
             "measuring chose | rounds under load |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in res["results"]:
        e = r["rows"]["eager"]["median"]
        f = r["fastest_heuristic"]
        lines.append(f"| {r['model']} | {r['batch']} | {e * 1e3:.2f} | {f} | {r['rows'][f]['median'] / e:.2f} | "
                     f"{r['learned_over_eager']:.2f} | {r['learned_over_fastest']:.3f} | "
                     f"{r['measured_over_eager']:.2f} | {r['measured_over_fastest']:.3f} | {r['chosen']} | "
                     f"{r['measured_chosen']} | "
                     f"{r['load']['loaded_rounds']}/{r['load']['rounds']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    from opsched.io import atomic_write_text
    from opsched.policies import load
    from opsched.policies.exported import pretrained_path

    ap = argparse.ArgumentParser(prog="bench/apply_zoo.py", description=doc_summary(__doc__))
    ap.add_argument("--models", default="inception,resnet50,nasnet,randwire,lstm,transformer")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--policy", default=str(pretrained_path()))
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    policy = load(args.policy)
    t0 = time.time()
    results = []
    for m in [x for x in args.models.split(",") if x]:
        for b in [int(x) for x in args.batches.split(",") if x]:
            r = measure(m, b, policy, args.rounds, args.warmup)
            results.append(r)
            print(f"{m:12s} b{b}: over the fastest heuristic ({r['fastest_heuristic']}): learned "
                  f"{r['learned_over_fastest']:.3f} (chose {r['chosen']}), measured {r['measured_over_fastest']:.3f} "
                  f"(chose {r['measured_chosen']}); measured/eager {r['measured_over_eager']:.2f}", flush=True)
    res = {"command": "python bench/apply_zoo.py " + " ".join(argv or []), "host": host_record(),
           "rounds": args.rounds, "results": results, "seconds": time.time() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "apply_zoo.json", json.dumps(res, indent=1, default=float))
    write_markdown(res, out / "apply_zoo.md")
    print(f"wrote {out / 'apply_zoo.md'}")
    return 0


__all__ = ["main", "measure"]
