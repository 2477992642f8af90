"""Training-step capture: how long it takes, what the graph holds, and what the replay costs.

For each zoo model (default: randwire and inception at batch 4, width 1, SGD
with momentum 0.9 and the zoo's default loss), measured in one process:

* capture time of ``capture_step`` (one call, after a small warm-up capture
  so that torch's one-time tracing setup is not charged to the first model);
* ops per phase (forward / backward / update), aten nodes, edges, GFLOPs;
* step time, interleaved round by round (``opsched.timing.interleave``: warm-up,
  then rounds that rotate the order), medians, at torch's default thread count:
  ``eager`` (``zero_grad``, forward, loss, ``backward``, ``optimizer.step``),
  ``replay`` (``StepRunner`` with the plain sequential runner
  ``run_node_by_node``: input building, every op in graph order, write-back),
  ``backend-inline`` (``TorchCPUBackend`` under a plan with every op on all
  cores: its inline path), and ``backend-cpf`` (critical-path-first's plan, an
  untuned heuristic on the default analytic model - informational only).
  Each configuration trains its own copy of the model from the same start.

Figures go to ``runs/bench/train_capture.{json,md}`` with the load they ran
under; on a shared machine they are not final.

    python -m opsched.benchmarks.train_capture [--models randwire,inception] [--batch 4] [--rounds 10] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import opsched.benchmarks.harness as H
from opsched.timing import host_record, interleave, wall_clock

if TYPE_CHECKING:
    from opsched.engine.contracts import Backend
    from opsched.machine import Machine


def _reexec_with_env(argv: Sequence[str]) -> None:
    from opsched.backends.torch_cpu import recommended_env

    env = recommended_env()
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv], {**os.environ, **env})


def measure_model(name: str, batch: int, width: float, rounds: int, warmup: int, machine: Machine,
                  backend: Backend) -> dict[str, Any]:
    import torch

    from opsched.importers.torch_step import StepRunner, capture_step
    from opsched.phases import phase_counts
    from opsched.plan import uniform_plan
    from opsched.policies import get_policy
    from opsched.zoo.training import build_train

    ex = build_train(name, batch=batch, width=width)

    def sgd(m: Any) -> Any:
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    t0 = time.perf_counter()
    module = copy.deepcopy(ex.module)
    opt = sgd(module)
    graph = capture_step(module, ex.loss_fn, opt, ex.inputs, ex.targets, name=name)
    capture_s = time.perf_counter() - t0

    eager_m = copy.deepcopy(ex.module)
    eager_opt = sgd(eager_m)

    def eager() -> None:
        eager_opt.zero_grad()
        ex.loss_fn(eager_m(*ex.inputs), ex.targets).backward()
        eager_opt.step()

    runners = {}
    for label in ("replay", "backend-inline", "backend-cpf"):
        m = copy.deepcopy(ex.module)
        o = sgd(m)
        runners[label] = StepRunner(graph, m, o)
    inline = uniform_plan(graph, machine, machine.cpu.cores, policy="inline-all")
    cpf = get_policy("critical-path-first").plan(graph, machine)
    configs = {
        "eager": wall_clock(eager),
        "replay": wall_clock(lambda: runners["replay"](ex.inputs, ex.targets)),
        "backend-inline": wall_clock(lambda: runners["backend-inline"](
            ex.inputs, ex.targets, execute=lambda inp: backend.execute(graph, inline, inp))),
        "backend-cpf": wall_clock(lambda: runners["backend-cpf"](
            ex.inputs, ex.targets, execute=lambda inp: backend.execute(graph, cpf, inp))),
    }
    timings = interleave(configs, warmup=warmup, repeats=rounds)
    ratios = timings.ratios("eager")
    return {
        "model": name, "batch": batch, "width": width, "capture_s": capture_s,
        "ops": len(graph.ops), "phases": phase_counts(graph), "aten_nodes": graph.meta["aten_nodes"],
        "edges": len(graph.edges), "gflops": graph.total_flops / 1e9,
        "step_s": {k: timings.stats(k) for k in configs},
        "vs_eager": {k: ratios[k]["median"] for k in configs},
        "load": timings.load_record(), "warning": timings.warning(),
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = ["# Training-step capture", "", result["command"], "",
             f"torch {result['torch']}, {result['threads']} intra-op threads for eager and replay", "",
             "| model | batch | capture s | ops (fwd / bwd / upd) | GFLOP | eager ms | replay ms | "
             "backend-inline ms | backend-cpf ms | replay / eager | load (others' cores, median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        ph, st = r["phases"], r["step_s"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['capture_s']:.1f} | {r['ops']} ({ph['forward']} / {ph['backward']} / "
            f"{ph['update']}) | {r['gflops']:.2f} | {st['eager']['median'] * 1e3:.1f} | "
            f"{st['replay']['median'] * 1e3:.1f} | {st['backend-inline']['median'] * 1e3:.1f} | "
            f"{st['backend-cpf']['median'] * 1e3:.1f} | {r['vs_eager']['replay']:.2f} | "
            f"{r['load']['others_cores_median']:.2f} |")
    warnings = [f"- {r['model']}: {r['warning']}" for r in result["rows"] if r["warning"]]
    return "\n".join(lines + ([""] + warnings if warnings else [])) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.train_capture",
                                 description=H.doc_summary(__doc__))
    ap.add_argument("--models", default="randwire,inception")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for eager and replay (default: torch's own default)")
    ap.add_argument("--out", default=str(H.DEFAULT_OUT))
    ap.add_argument("--no-reexec", action="store_true", help="do not restart with the recommended malloc env")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if not args.no_reexec:
        _reexec_with_env(raw)

    import torch
    from torch import nn

    from opsched.backends.torch_cpu import TorchCPUBackend
    from opsched.importers.torch_step import capture_step
    from opsched.machine import Machine

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    machine = Machine.probe()
    backend = TorchCPUBackend(machine)
    warm = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 3))
    capture_step(warm, nn.functional.cross_entropy, torch.optim.SGD(warm.parameters(), lr=0.1),
                 torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2,)))  # one-time tracing setup
    rows = [measure_model(m, args.batch, args.width, args.rounds, args.warmup, machine, backend)
            for m in args.models.split(",") if m]
    backend.close()
    result = {"command": " ".join(["python -m opsched.benchmarks.train_capture", *raw]), "host": host_record(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    name = "train_capture" + (f"_t{args.threads}" if args.threads > 0 else "")
    md = H.save_result(Path(args.out), name, result, _markdown(result))
    print(md.read_text())


if __name__ == "__main__":
    main()
