"""``opsched apply`` on every zoo model at batch 1 and 8: the apply table of the export/apply issue.

Each (model, batch) runs the real command line in its own process (started
with :func:`~opsched.backends.torch_cpu.recommended_env`, as a user's
benchmark should), which plans with the policy, runs eager PyTorch,
critical-path-first and the policy interleaved on this machine's runtime,
checks every output against eager and writes its figures with ``--json``.
This script only gathers those files into one table: a failed command (an
output that differs from eager included) is reported as such, never
skipped silently.

    python bench/apply_zoo.py                         # -> runs/bench/apply_zoo.{json,md}
    python bench/apply_zoo.py --models lstm --batches 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ZOO_MODELS = ("inception", "resnet50", "nasnet", "randwire", "lstm", "transformer")


def run_one(model: str, batch: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``opsched apply`` process; its JSON, or the reason it failed."""
    from opsched.backends.torch_cpu import recommended_env

    js = out / f"{model}_b{batch}.json"
    js.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "opsched", "apply", "--model", f"zoo:{model}", "--batch", str(batch),
           "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--json", str(js)]
    if args.policy:
        cmd += ["--policy", args.policy]
    env = {**os.environ, **recommended_env(), "COLUMNS": "120"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    (out / f"{model}_b{batch}.txt").write_text(proc.stdout + proc.stderr)
    res: dict[str, Any] = {"model": model, "batch": batch, "rc": proc.returncode,
                           "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[1:])}
    if js.is_file():
        res.update(json.loads(js.read_text()))
    else:
        res["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return res


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# `opsched apply` on the zoo", "",
             f"`{meta['command']}` on {meta['cpu']} ({meta['cores']} cores); load average "
             f"{meta['load_start']:.1f} at start, {meta['load_end']:.1f} at end; {meta['elapsed_s']:.0f} s.", "",
             "Per (model, batch) one `opsched apply` process: eager PyTorch (default threads), "
             "critical-path-first and the policy on opsched's runtime, interleaved, median ms per run; "
             "speed-ups over eager; every output checked against eager.", "",
             "| model | batch | ops | eager ms | critical-path-first ms | policy ms | cpf vs eager | "
             "policy vs eager | policy vs cpf | planning ms | outputs = eager |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if "rows" not in r:
            lines.append(f"| {r['model']} | {r['batch']} | | | | | | | | | **failed** (exit {r['rc']}): "
                         f"{' '.join(r.get('error', []))[:120]} |")
            continue
        rows = {x["config"]: x for x in r["rows"]}
        pol = next(x for name, x in rows.items() if name not in ("eager", "critical-path-first"))
        eager, cpf = rows["eager"], rows["critical-path-first"]
        ok = all(x["outputs_equal_eager"] for x in r["rows"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['n_ops']} | {eager['median_s'] * 1e3:.2f} | "
            f"{cpf['median_s'] * 1e3:.2f} | {pol['median_s'] * 1e3:.2f} | {cpf['speedup']:.2f}x | "
            f"{pol['speedup']:.2f}x | {r['policy_vs_cpf']:.2f}x | {r['plan_s'] * 1e3:.1f} | "
            f"{'yes' if ok else '**no**'} |")
    lines += ["", f"Policy: {results[0].get('policy', '?') if results else '?'}. Raw figures: `apply_zoo.json`; "
              "each command's output: `apply/<model>_b<batch>.txt`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO_MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--policy", default="", help="exported policy folder (default: the shipped pretrained one)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per apply command")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    (out / "apply").mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    results = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            r = run_one(model, batch, args, out / "apply")
            results.append(r)
            status = "ok" if "rows" in r else f"FAILED: {r.get('error')}"
            print(f"{model:12s} batch {batch}: {status} ({r['seconds']:.0f} s)", flush=True)
    meta = {"command": "python bench/apply_zoo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_start": load0, "load_end": os.getloadavg()[0], "elapsed_s": time.perf_counter() - t0}
    from opsched.io import atomic_write_text

    atomic_write_text(out / "apply_zoo.json", json.dumps({**meta, "results": results}, indent=1) + "\n")
    atomic_write_text(out / "apply_zoo.md", markdown(results, meta))
    print(f"wrote {out / 'apply_zoo.md'}")
    return 0 if all("rows" in r and r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
