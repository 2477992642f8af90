"""GPU benchmarks of issue 8 (run by the repository's ``bench/gpu_check.sh``; needs a CUDA GPU).

Three sets of figures in ``OUT/gpu_bench.{json,md}``: opsched's multi-stream
runtime against eager CUDA (:func:`speedup_case`), the simulator against
measured GPU makespans (:func:`sim_case`), and with two or more GPUs, maestro
and the learned policy against one GPU (:func:`multi_gpu_case`).  Everything
is budgeted (``--budget-s``): cases past the budget are listed as skipped.
Exit status 3 when no CUDA GPU is present (nothing is measured).

    python -m opsched.benchmarks.gpu_bench --out runs/gpu_check_X   # what gpu_check.sh runs
    python -m opsched.benchmarks.gpu_bench --quick                  # two models, fewer rounds
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import opsched.benchmarks.harness as H
from opsched.timing import host_record, interleave, summary

NO_GPU = 3


def _median(xs: Sequence[float]) -> float:
    return summary(xs)["median"]


def _check_cuda() -> Any:
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_bench: no CUDA GPU: torch is not importable ({exc}); nothing was measured", file=sys.stderr)
        raise SystemExit(NO_GPU) from None
    if not torch.cuda.is_available():
        print(f"gpu_bench: no CUDA GPU is visible to torch {torch.__version__} "
              f"({'a CPU-only build' if torch.version.cuda is None else 'CUDA ' + str(torch.version.cuda)}); "
              "nothing was measured", file=sys.stderr)
        raise SystemExit(NO_GPU)
    return torch


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allow(self, what: str, need_s: float = 5.0) -> bool:
        if self.left() < need_s:
            self.skipped.append(what)
            return False
        return True


# ---------------------------------------------------------------- helpers
def _timed(torch: Any, fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _capture_eager(torch: Any, module: Any, inputs: tuple) -> Any:
    static = tuple(x.clone() for x in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            module(*static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = module(*static)
    return lambda: (g.replay(), out)[1]


def _one_stream(machine: Any) -> Any:
    import dataclasses

    return dataclasses.replace(machine, name=machine.name + "-1stream", devices=tuple(
        dataclasses.replace(d, cores=1) if d.is_gpu else d for d in machine.devices))


def _cpf_plan(graph: Any, machine: Any, model: Any = None, device: str = "gpu:0") -> Any:
    """Every op on ``device``, priorities = upward rank at the model's GPU times (Graphi's CPF)."""
    from opsched.engine.models.analytic import default_model
    from opsched.plan import uniform_plan

    model = model or default_model()
    dev = machine.device(device)
    t = {op.id: float(model.op_time(op, dev, 1)) for op in graph.ops}
    return uniform_plan(graph, machine, 1, device=device, priority=graph.upward_rank(t), policy=f"cpf-{device}")


def _close(torch: Any, a: Any, b: Any) -> tuple[bool, float]:
    fa, fb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(fa, fb, strict=True)), default=0.0)
    ok = len(fa) == len(fb) and all(torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-3)
                                    for x, y in zip(fa, fb, strict=True))
    return ok, diff


# ------------------------------------------------------- 1. multi-stream
def speedup_case(torch: Any, name: str, batch: int, machine: Any, rounds: int) -> dict[str, Any]:
    """Multi-stream speedup over eager CUDA: ``eager`` (``module(*inputs)`` on the
    GPU), ``streams-1`` (opsched's runtime, every op on one stream), ``streams-N``
    (the GPU's ``cores`` streams, critical-path-first priorities), and the
    CUDA-graph versions ``eager+graph`` and ``streams-N+graph`` (Nimble's
    setting), interleaved round by round (:func:`opsched.timing.interleave`, each
    call synchronised); ratios taken within a round, then the median.  Outputs
    of ``streams-N`` are checked against eager."""
    from opsched.backends.torch_cuda import TorchCUDABackend
    from opsched.importers.torch_fx import from_torch
    from opsched.zoo import ZOO

    module, inputs = ZOO[name].build(batch=batch)
    graph = from_torch(module, inputs, name=name)
    dev = torch.device("cuda:0")
    module = module.to(dev)
    cuda_in = tuple(x.to(dev) for x in inputs)
    one = _one_stream(machine)
    rec: dict[str, Any] = {"model": name, "batch": batch, "ops": len(graph.ops),
                           "streams": machine.device("gpu:0").cores}
    with torch.no_grad(), TorchCUDABackend(machine) as multi, TorchCUDABackend(one) as single:
        plan_n, plan_1 = _cpf_plan(graph, machine), _cpf_plan(graph, one)
        ref = module(*cuda_in)
        out = multi.execute(graph, plan_n, cuda_in)
        rec["outputs_equal_eager"], rec["max_abs_diff"] = _close(torch, out, ref)
        configs = {
            "eager": lambda: module(*cuda_in),
            "streams-1": lambda: single.execute(graph, plan_1, cuda_in),
            "streams-N": lambda: multi.execute(graph, plan_n, cuda_in),
        }
        try:
            configs["eager+graph"] = _capture_eager(torch, module, cuda_in)
            cap = multi.capture(graph, plan_n, *cuda_in)
            configs["streams-N+graph"] = lambda: cap.replay(*cap.static_inputs)
            ok, diff = _close(torch, cap.replay(*cuda_in), ref)
            rec["graph_outputs_equal_eager"] = ok
        except Exception as exc:  # noqa: BLE001 - reported, the other figures still stand
            rec["graph_error"] = f"{type(exc).__name__}: {exc}"
        timings = interleave({k: (lambda fn=fn: _timed(torch, fn)) for k, fn in configs.items()}, 3, rounds)
        times = timings.samples
        rec["ms"] = {k: 1e3 * _median(v) for k, v in times.items()}
        rec["rounds"], rec["load"] = len(times["eager"]), timings.load_record()

        def ratio(a: str, b: str) -> float:  # how many times faster b is than a
            return timings.ratios(b)[a]["median"]

        rec["speedup"] = {"streams-N_vs_eager": ratio("eager", "streams-N"),
                          "streams-N_vs_streams-1": ratio("streams-1", "streams-N")}
        if "streams-N+graph" in times:
            rec["speedup"]["streams-N+graph_vs_eager"] = ratio("eager", "streams-N+graph")
            rec["speedup"]["streams-N+graph_vs_eager+graph"] = ratio("eager+graph", "streams-N+graph")
    return rec


# ----------------------------------------------------------- 2. sim error
def sim_case(torch: Any, name: str, batch: int, machine: Any, out: Path, traced: int) -> dict[str, Any]:
    """Every op profiled on the GPU (``backends/gpu_profiler.py``), then for a
    single-stream, a multi-stream and a CPU+GPU (HEFT) plan the measured makespan
    (median over traced runs) against the simulated one, with the analytic
    model's nominal GPU figures (``raw``) and with the measured op times and link
    (``calibrated``: :class:`GPUProfileModel`)."""
    from opsched.backends.gpu_profiler import profile_gpu
    from opsched.backends.sim import SimBackend
    from opsched.backends.torch_cuda import TorchCUDABackend
    from opsched.engine.models.analytic import default_model
    from opsched.engine.models.gpu import GPUProfileModel
    from opsched.importers.torch_fx import from_torch
    from opsched.policies import get_policy
    from opsched.zoo import ZOO

    module, inputs = ZOO[name].build(batch=batch)
    graph = from_torch(module, inputs, name=name)
    prof = profile_gpu(graph, machine, cache_dir=out / "profiles", progress=False, repeats=15)
    calibrated = GPUProfileModel(prof)
    raw = default_model()
    one = _one_stream(machine)
    plans = {"single-stream": (one, _cpf_plan(graph, one, calibrated)),
             "multi-stream": (machine, _cpf_plan(graph, machine, calibrated))}
    try:
        plans["cpu+gpu (heft)"] = (machine, get_policy("heft").plan(graph, machine, calibrated))
    except Exception as exc:  # noqa: BLE001
        plans_note = f"heft plan failed: {type(exc).__name__}: {exc}"
    else:
        plans_note = ""
    rows = []
    dev = torch.device("cuda:0")
    cuda_in = tuple(x.to(dev) for x in inputs)
    for label, (m, plan) in plans.items():
        with TorchCUDABackend(m) as be:
            be.run(graph, plan, cuda_in)  # warm-up
            spans = [be.run(graph, plan, cuda_in).makespan for _ in range(traced)]
            walls = []
            for _ in range(traced):
                walls.append(_timed(torch, lambda be=be, plan=plan: be.execute(graph, plan, cuda_in)))
        measured = _median(spans)
        sim_raw = SimBackend(m, model=raw).run(graph, plan).makespan
        sim_cal = SimBackend(m, model=calibrated).run(graph, plan).makespan
        devices = sorted({plan[op.id].device for op in graph.ops})
        rows.append({"plan": label, "devices": devices, "measured_ms": 1e3 * measured,
                     "untimed_wall_ms": 1e3 * _median(walls),
                     "sim_raw_ms": 1e3 * sim_raw, "sim_calibrated_ms": 1e3 * sim_cal,
                     "err_raw": abs(sim_raw - measured) / measured,
                     "err_calibrated": abs(sim_cal - measured) / measured})
    launch = prof.settings.get("launch_s", {})
    return {"model": name, "batch": batch, "ops": len(graph.ops), "plans": rows, "note": plans_note,
            "sum_gpu_op_ms": 1e3 * sum(p.median[1] for p in prof.ops.values()),
            "sum_host_launch_ms": 1e3 * sum(launch.values()), "link": prof.settings.get("link")}


# ----------------------------------------------------------- 3. multi-GPU
def multi_gpu_case(torch: Any, name: str, batch: int, machine: Any, rounds: int, out: Path) -> dict[str, Any]:
    """``maestro`` and the shipped learned policy against single-GPU execution (two or more GPUs)."""
    from opsched.backends.gpu_profiler import profile_gpu
    from opsched.backends.torch_cuda import TorchCUDABackend
    from opsched.engine.models.gpu import GPUProfileModel
    from opsched.importers.torch_fx import from_torch
    from opsched.policies import get_policy, load
    from opsched.policies.exported import pretrained_path
    from opsched.zoo import ZOO

    module, inputs = ZOO[name].build(batch=batch)
    graph = from_torch(module, inputs, name=name)
    model = GPUProfileModel(profile_gpu(graph, machine, cache_dir=out / "profiles", progress=False, repeats=10))
    plans = {"single-gpu": _cpf_plan(graph, machine, model), "maestro": get_policy("maestro").plan(graph, machine, model)}
    rec: dict[str, Any] = {"model": name, "batch": batch, "gpus": len(machine.gpus)}
    pretrained = pretrained_path()
    if pretrained.exists():
        try:
            plans["learned"] = load(pretrained).plan(graph, machine, model)
        except Exception as exc:  # noqa: BLE001
            rec["learned_error"] = f"{type(exc).__name__}: {exc}"
    else:
        rec["learned_error"] = f"{pretrained} not found (no exported policy yet)"
    cuda_in = tuple(x.cuda() for x in inputs)
    with TorchCUDABackend(machine) as be:
        ref = be.execute(graph, plans["single-gpu"], cuda_in)
        for k, p in plans.items():
            rec[f"{k}_outputs_equal"] = _close(torch, be.execute(graph, p, cuda_in), ref)[0]
            rec[f"{k}_gpus_used"] = sorted({p[op.id].device for op in graph.ops})
        timings = interleave({k: (lambda p=p: _timed(torch, lambda: be.execute(graph, p, cuda_in)))
                              for k, p in plans.items()}, 2, rounds)
    rec["ms"] = {k: 1e3 * _median(v) for k, v in timings.samples.items()}
    rec["speedup_vs_single_gpu"] = {k: timings.ratios(k)["single-gpu"]["median"] for k in plans if k != "single-gpu"}
    return rec


# ---------------------------------------------------------------- report
def _markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    lines = ["# GPU benchmarks (issue 8)", "",
             f"{env['gpus']} x {env['gpu_name']} - torch {env['torch']} (CUDA {env['cuda']}) - "
             f"{env['when']} - `{env['command']}`", ""]
    lines += ["## Multi-stream speedup over eager CUDA", "",
              "Median ms per forward (end to end, synchronised); speedups are medians of per-round ratios.", "",
              "| model | batch | ops | eager | 1 stream | N streams | N vs eager | eager+graph | N+graph "
              "| N+graph vs eager | N+graph vs eager+graph | outputs = eager |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["speedup"]:
        ms, sp = r.get("ms", {}), r.get("speedup", {})

        def f(x: Any, unit: str = "") -> str:
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}{unit}"

        lines.append(f"| {r['model']} | {r['batch']} | {r['ops']} | {f(ms.get('eager'))} | {f(ms.get('streams-1'))} "
                     f"| {f(ms.get('streams-N'))} | {f(sp.get('streams-N_vs_eager'), 'x')} "
                     f"| {f(ms.get('eager+graph'))} | {f(ms.get('streams-N+graph'))} "
                     f"| {f(sp.get('streams-N+graph_vs_eager'), 'x')} "
                     f"| {f(sp.get('streams-N+graph_vs_eager+graph'), 'x')} | {r.get('outputs_equal_eager')} |")
    if res["sim"]:
        lines += ["", "## Simulator error against measured GPU makespans", "",
                  "| model | batch | plan | measured ms | sim raw ms | err raw | sim calibrated ms | err calibrated |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in res["sim"]:
            for p in c["plans"]:
                lines.append(f"| {c['model']} | {c['batch']} | {p['plan']} | {p['measured_ms']:.3g} | "
                             f"{p['sim_raw_ms']:.3g} | {p['err_raw']:.0%} | {p['sim_calibrated_ms']:.3g} | "
                             f"{p['err_calibrated']:.0%} |")
        s = res["sim_summary"]
        lines += ["", f"Median absolute error: raw {s['median_err_raw']:.0%}, calibrated "
                      f"{s['median_err_calibrated']:.0%} over {s['n']} (model, batch, plan) cases."]
    lines += ["", "## Multi-GPU", ""]
    if not res["multi_gpu"]:
        lines.append(res.get("multi_gpu_note", "fewer than two GPUs: not measured"))
    for r in res["multi_gpu"]:
        lines.append(f"- {r['model']} batch {r['batch']}: ms {json.dumps({k: round(v, 3) for k, v in r['ms'].items()})}"
                     f", speedup vs single GPU {json.dumps({k: round(v, 3) for k, v in r['speedup_vs_single_gpu'].items()})}"
                     + (f"; learned: {r['learned_error']}" if "learned_error" in r else ""))
    if res["skipped"] or res["errors"]:
        lines += ["", "## Not measured", ""]
        lines += [f"- skipped (time budget): {s}" for s in res["skipped"]]
        lines += [f"- error: {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from opsched.zoo import ZOO

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.gpu_bench",
                                 description=H.doc_summary(__doc__))
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/gpu_check_<timestamp>)")
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo models")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=260.0, help="stop starting new cases after this long")
    ap.add_argument("--quick", action="store_true", help="two models, batch 1, few rounds (smoke run)")
    args = ap.parse_args(argv)
    torch = _check_cuda()

    from opsched.machine import Machine

    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    rounds = args.rounds
    if args.quick:
        models, batches, rounds = models[:2], batches[:1], min(rounds, 5)
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        ap.error(f"unknown zoo model(s) {unknown}; choose from {', '.join(ZOO)}")
    out = args.out or Path("runs") / f"gpu_check_{_dt.datetime.now():%Y%m%d_%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    torch.backends.cudnn.benchmark = False
    machine = Machine.probe()
    res: dict[str, Any] = {
        "env": {"gpus": torch.cuda.device_count(), "gpu_name": torch.cuda.get_device_name(0),
                "torch": torch.__version__, "cuda": torch.version.cuda, "host": host_record(),
                "when": _dt.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                "machine": machine.to_dict(), "tf32_cudnn": torch.backends.cudnn.allow_tf32},
        "speedup": [], "sim": [], "multi_gpu": [], "skipped": budget.skipped, "errors": [],
    }

    def save() -> None:
        H.save_result(out, "gpu_bench", res, _markdown(res))

    def attempt(key: str, what: str, need_s: float, case: Any) -> None:
        """Run one case if the budget allows (else it is listed as skipped); a failure is recorded."""
        if not budget.allow(what, need_s):
            return
        print(f"[{what}]", flush=True)
        try:
            res[key].append(case())
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
        save()

    for name in models:
        for batch in batches:
            attempt("speedup", f"speedup {name} batch {batch}", 8,
                    lambda n=name, b=batch: speedup_case(torch, n, b, machine, rounds))
    for name in models:
        for batch in batches:
            attempt("sim", f"sim error {name} batch {batch}", 8,
                    lambda n=name, b=batch: sim_case(torch, n, b, machine, out, traced=5 if args.quick else 7))
    errs = [(p["err_raw"], p["err_calibrated"]) for c in res["sim"] for p in c["plans"]]
    res["sim_summary"] = {"median_err_raw": _median([e[0] for e in errs]),
                          "median_err_calibrated": _median([e[1] for e in errs]), "n": len(errs)}
    if len(machine.gpus) >= 2:
        for name in models:
            attempt("multi_gpu", f"multi-gpu {name} batch {batches[-1]}", 10,
                    lambda n=name: multi_gpu_case(torch, n, batches[-1], machine, max(5, rounds // 2), out))
    else:
        res["multi_gpu_note"] = f"{len(machine.gpus)} GPU(s): maestro and the learned policy need two or more"
    save()
    print((out / "gpu_bench.md").read_text())
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
