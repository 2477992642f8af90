"""A second OpenMP team and what it costs the rest of the process (``backends/executor.py``).

When two multi-threaded ops of a plan run side by side, the second runs on an
executor worker, which opens an OpenMP team of its own.  While that team lives
the process holds more OpenMP threads than CPUs, libgomp stops spin-waiting at
its barriers, and every parallel region of the process pays for waking sleeping
helpers - eager PyTorch's included.  Since this benchmark's change the worker's
thread exits when the run ends (``WorkerPool(retire_teams=True)``, the default).

Interleaved in one process, every call after the threads of the one before went
quiet (``opsched.timing.interleave``):

* ``eager``: the eager training step of a zoo model (default inception, batch 4)
  with the process at one team;
* ``eager after co-run, retired``: the same step right after a 4-slot plan ran
  two 2-thread matmuls side by side (its worker then retired);
* ``eager after co-run, kept``: the same with the worker kept alive (the old
  behaviour; retired again after the timed step, so later calls start clean);
* ``co-run plan, retired``: that plan's own run, a fresh worker thread and team
  each time; ``co-run plan, kept``: the old steady state, its worker's team
  already open from the run before (and the process throttled meanwhile).

    python -m opsched.benchmarks.omp_teams [--model inception] [--batch 4] [--rounds 11] [--out runs/bench]

Writes ``<out>/omp_teams.json`` and ``omp_teams.md`` (ms, medians, ratios to
``eager`` round by round, the load).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opsched.benchmarks import harness as H

#: The co-run plan: two independent 2-thread ops on 4 core slots, each ``MATMULS`` products of
#: ``SIZE`` x ``SIZE`` matrices (the caller runs one, a worker the other).
SIZE, MATMULS = 384, 4


def corun_pool(retire: bool) -> tuple[Any, Any, Callable[[], None]]:
    """(pool, compiled plan, run once): a 4-slot pool whose run co-runs two 2-thread matmul ops."""
    import torch

    from opsched.backends.executor import CompiledPlan, WorkerPool

    a = torch.randn(SIZE, SIZE)

    def op(values: list) -> None:
        x = a
        for _ in range(MATMULS):
            x = x @ a

    def no_grad() -> None:
        torch.set_grad_enabled(False)

    pool = WorkerPool(4, None, name="omp-teams", set_threads=torch.set_num_threads,
                      get_threads=torch.get_num_threads, thread_init=no_grad, retire_teams=retire)
    cp = CompiledPlan(["a", "b"], [op, op], [2, 2], [0, 1], [[], []], 4)
    pool.ensure_workers(2)

    def run() -> None:
        before = torch.get_num_threads()
        try:
            pool.run(cp, [])
        finally:
            torch.set_num_threads(before)

    return pool, cp, run


def measure(model: str, batch: int, rounds: int) -> dict[str, Any]:
    import torch

    from opsched.adapters.train import eager_step
    from opsched.specs import load_training
    from opsched.timing import host_record, interleave

    net, x, y = load_training(f"zoo:{model}", batch, 1.0, optimizer="sgd")
    kept_pool, _, kept_run = corun_pool(retire=False)
    retired_pool, _, retired_run = corun_pool(retire=True)

    def clean() -> None:  # back to one team: the kept pool's team-holding worker exits now
        kept_pool.release_teams()

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def step() -> None:
        eager_step(net, x, y)

    def after_kept() -> float:
        kept_run()
        try:
            return timed(step)
        finally:
            clean()

    def after_retired() -> float:
        retired_run()
        return timed(step)

    def plan_kept() -> float:
        kept_run()  # the team is open, as after every run of the old behaviour
        try:
            return timed(kept_run)
        finally:
            clean()

    configs = {"eager": lambda: timed(step), "eager after co-run, retired": after_retired,
               "eager after co-run, kept": after_kept, "co-run plan, retired": lambda: timed(retired_run),
               "co-run plan, kept": plan_kept}
    try:
        t = interleave(configs, warmup=2, repeats=rounds)
    finally:
        kept_pool.close()
        retired_pool.close()
    ratios = t.ratios("eager")
    rows = {name: {"median_ms": t.median(name) * 1e3, "q1_ms": t.stats(name)["q1"] * 1e3,
                   "q3_ms": t.stats(name)["q3"] * 1e3, "over_eager": ratios[name]["median"]} for name in configs}
    plan_cost = t.ratios("co-run plan, kept")["co-run plan, retired"]["median"]
    return {"model": model, "batch": batch, "rounds": rounds, "torch_threads": torch.get_num_threads(),
            "rows": rows, "retired_plan_over_kept": plan_cost, "load": t.load_record(), "host": host_record(),
            "warning": t.warning()}


def report(res: dict[str, Any]) -> str:
    lines = [f"# A second OpenMP team: {res['model']} b{res['batch']}'s eager training step", "",
             f"{res['rounds']} interleaved rounds in one process, medians; torch at {res['torch_threads']} threads; "
             f"load average {res['load']['loadavg_start']} -> {res['load']['loadavg_end']}, other processes' cores "
             f"median {res['load']['others_cores_median']:.2f}.  Ratio: time over `eager`'s, round by round.", "",
             "| configuration | ms (q1-q3) | over eager |", "|---|---:|---:|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['median_ms']:.2f} ({r['q1_ms']:.2f}-{r['q3_ms']:.2f}) | {r['over_eager']:.3f} |")
    lines += ["", f"The co-run plan's own run with its worker retired over kept: x{res['retired_plan_over_kept']:.3f} "
                  "(a fresh thread and team per run, against a team kept open)."]
    if res.get("warning"):
        lines += ["", f"Warning: {res['warning']}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.omp_teams", description=H.doc_summary(__doc__))
    ap.add_argument("--model", default="inception", help="zoo model whose eager training step is timed")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", type=Path, default=H.DEFAULT_OUT, help="output folder (default runs/bench)")
    args = ap.parse_args(argv)
    res = measure(args.model, args.batch, args.rounds)
    md = H.save_result(args.out, "omp_teams", res, report(res))
    rows = res["rows"]
    print(f"eager {rows['eager']['median_ms']:.1f} ms; after a co-run plan: worker retired x"
          f"{rows['eager after co-run, retired']['over_eager']:.3f}, kept x"
          f"{rows['eager after co-run, kept']['over_eager']:.3f} -> {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
