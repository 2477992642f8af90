"""The zoo through the PyTorch importer: sizes, import time, and the cost of
running a graph op by op (``TorchSource.run_node_by_node``, the baseline every
runtime is measured against) next to the module's own eager forward.

For each zoo model at its defaults (batch 1): ops, edges, GFLOPs, width; the
median import time; then, interleaved round by round so load drifts hit them
alike, the eager ``module(*inputs)``, the fx ``GraphModule`` forward (fx's own
generated code) and ``run_node_by_node``.  Overhead per op =
(median node-by-node - median eager) / ops; the ratio is the median over rounds
of node-by-node / eager within a round.  All under ``torch.no_grad`` at
``--threads`` intra-op threads (default 1: least noise on a shared machine).

    python bench/zoo_import.py            # writes runs/bench/zoo_import.{json,md}
    python bench/zoo_import.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def measure(configs: dict[str, Any], rounds: int, warmup: int) -> dict[str, list[float]]:
    names = list(configs)
    for _ in range(warmup):
        for name in names:
            configs[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        rot = r % len(names)
        for name in names[rot:] + names[:rot]:
            t0 = time.perf_counter()
            configs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="few rounds: a smoke run, not a measurement")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup = 5, 1

    import torch

    from opsched.importers.torch_fx import from_torch
    from opsched.io import atomic_write_text
    from opsched.zoo import ZOO

    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": args.threads},
        "rounds": args.rounds, "quick": args.quick, "models": {},
    }
    for name, z in ZOO.items():
        module, inputs = z.build(batch=1)
        imports = []
        for _ in range(1 if args.quick else 3):
            t0 = time.perf_counter()
            g = from_torch(module, inputs, name=name)
            imports.append(time.perf_counter() - t0)
        src = g.source
        with torch.no_grad():
            ref = module(*inputs)
        assert torch.equal(src.run_node_by_node(*inputs), ref), name

        def eager(m=module, x=inputs):
            with torch.no_grad():
                return m(*x)

        def fx_forward(gm=src.gm, x=inputs):
            with torch.no_grad():
                return gm(*x)

        times = measure({"eager": eager, "fx GraphModule": fx_forward,
                         "node-by-node": lambda s=src, x=inputs: s.run_node_by_node(*x)},
                        args.rounds, args.warmup)
        med = {k: statistics.median(v) for k, v in times.items()}
        n = len(g.ops)
        s = g.summary()
        res["models"][name] = {
            **{k: s[k] for k in ("ops", "edges", "gflops", "width", "depth")},
            "import_s": statistics.median(imports),
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "node_by_node_over_eager": statistics.median(
                b / a for a, b in zip(times["eager"], times["node-by-node"], strict=True)),
            "overhead_us_per_op": (med["node-by-node"] - med["eager"]) / n * 1e6,
        }
        print(name, json.dumps(res["models"][name]), flush=True)
    out = Path(args.out)
    atomic_write_text(out / "zoo_import.json", json.dumps(res, indent=1))
    atomic_write_text(out / "zoo_import.md", markdown(res))
    print(markdown(res))


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Zoo import and node-by-node execution",
        "",
        f"`{res['command']}`: {res['machine']['cpus']} CPUs, torch {res['machine']['torch']}, "
        f"{res['machine']['threads']} intra-op thread(s), {res['rounds']} interleaved rounds, medians"
        + (" (QUICK smoke run)" if res["quick"] else "") + ".",
        "",
        "| model | ops | edges | GFLOPs | width | depth | import s | eager ms | fx ms | node-by-node ms "
        "| nbn / eager | overhead us/op |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in res["models"].items():
        t = m["median_ms"]
        lines.append(
            f"| {name} | {m['ops']} | {m['edges']} | {m['gflops']:.3f} | {m['width']} | {m['depth']} "
            f"| {m['import_s']:.2f} | {t['eager']:.2f} | {t['fx GraphModule']:.2f} | {t['node-by-node']:.2f} "
            f"| {m['node_by_node_over_eager']:.3f} | {m['overhead_us_per_op']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
