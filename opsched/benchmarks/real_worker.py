"""One benchmark configuration in its own process (driven by :class:`opsched.benchmarks.harness.Worker`).

Each configuration owns thread pools that spin or pin, so each runs alone in
a process that prepares it once and then answers timing requests as JSON
lines (the protocol: :func:`main`; the kinds: :func:`build`).

    python -m opsched.benchmarks.real_worker --kind KIND --model NAME --batch B [options]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PROTO: Any = None


def _take_stdout() -> None:
    """Keep a duplicate of stdout for the protocol and point fd 1 at stderr."""
    global _PROTO
    _PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def say(msg: dict[str, Any]) -> None:
    _PROTO.write(json.dumps(msg) + "\n")
    _PROTO.flush()


def first_tensor(out: Any) -> Any:
    import numpy as np
    import torch

    stack = [out]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return x.detach().float().reshape(-1).numpy().copy()
        if isinstance(x, np.ndarray):
            return x.astype(np.float32).reshape(-1).copy()
        if isinstance(x, (list, tuple)):
            stack = list(x) + stack
        elif isinstance(x, dict):
            stack = list(x.values()) + stack
    return None


def reset_peak_rss() -> float:
    """Return freed heap pages to the OS (``malloc_trim``) and reset the peak-RSS counter
    (``/proc/self/clear_refs``): the peak then measures what the timed calls keep resident, not
    what setting the configuration up once took.  Returns the resident MB now."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """Peak resident MB since :func:`reset_peak_rss` (``VmHWM``), else the process's lifetime peak."""
    hwm = _status_mb("VmHWM")
    if hwm == hwm:  # not NaN
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _status_mb(key: str) -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def build(args: argparse.Namespace) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """The callables to time, by name, and facts for the report.  Kinds, each the
    way a user would run the model, nothing tuned on the side:

    * ``eager``: the module called in ``torch.no_grad()`` with PyTorch's default threads;
    * ``eager-1t``: the same after ``torch.set_num_threads(1)``;
    * ``compile``: ``torch.compile(module)`` (default mode, inductor), compiled at start-up;
    * ``ort-seq``: ONNX Runtime, ``ORT_SEQUENTIAL`` execution mode, default threads and optimisations;
    * ``ort-par``: ONNX Runtime, ``ORT_PARALLEL`` execution mode (independent nodes side by side);
    * ``opsched-ort``: ``opsched.apply(policy, module, inputs, backend="ort")``, what
      ``opsched apply`` runs by default: the policy's plan as co-running ONNX
      Runtime sessions, or ONNX Runtime's one session when the planning model
      (``--profiles``) predicts no plan faster;
    * ``opsched``: opsched's ``TorchCPUBackend.execute`` under every plan in ``--plans DIR``
      (``<name>.json`` each; the machine in ``--machine``), one process for all
      plans since they share the runtime's executor pool."""
    import torch

    from opsched.specs import load_torch_model

    if args.kind.startswith("train-"):
        return build_train_step(args)
    info: dict[str, Any] = {}
    if args.kind == "eager-1t":
        torch.set_num_threads(1)
    module, inputs = load_torch_model(f"zoo:{args.model}", args.batch)
    info["torch_threads"] = torch.get_num_threads()

    if args.kind in ("eager", "eager-1t"):
        def eager() -> Any:
            with torch.no_grad():
                return module(*inputs)
        return {args.kind: eager}, info

    if args.kind == "compile":
        compiled = torch.compile(module)
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(*inputs)
        info["compile_s"] = time.perf_counter() - t0

        def run_compiled() -> Any:
            with torch.no_grad():
                return compiled(*inputs)
        return {"compile": run_compiled}, info

    if args.kind in ("ort-seq", "ort-par"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL if args.kind == "ort-par" else \
            ort.ExecutionMode.ORT_SEQUENTIAL
        sess = ort.InferenceSession(args.onnx, so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        if len(names) != len(inputs):
            raise RuntimeError(f"{args.onnx}: the ONNX graph takes {len(names)} inputs, the model {len(inputs)}")
        feeds = {n: x.detach().numpy() for n, x in zip(names, inputs)}
        info["ort_version"] = ort.__version__
        return {args.kind: lambda: sess.run(None, feeds)}, info

    if args.kind == "opsched-ort":
        import warnings

        from opsched.planning import planning_model
        from opsched.scheduled import ScheduleFallbackWarning, apply
        from opsched.specs import load_machine

        machine = load_machine("local").cpu_only()
        model = planning_model(machine, "ort", "auto", args.profiles or None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ScheduleFallbackWarning)
            sm = apply(args.policy or None, module, inputs, backend="ort", machine=machine, perf_model=model)
        info["plan"] = sm.plan.policy if sm.plan is not None else None
        info["fallback"] = sm.fallback_reason or ("; ".join(str(w.message) for w in caught) or None)

        def scheduled() -> Any:
            with torch.no_grad():
                return sm(*inputs)
        return {"opsched-ort": scheduled}, info

    if args.kind == "opsched":
        from opsched.backends.torch_cpu import TorchCPUBackend
        from opsched.importers.torch_fx import from_torch
        from opsched.machine import Machine
        from opsched.plan import Plan

        machine = Machine.from_dict(json.loads(Path(args.machine).read_text()))
        graph = from_torch(module, inputs, name=args.model)
        backend = TorchCPUBackend(machine)
        fns: dict[str, Callable[[], Any]] = {}
        for path in sorted(Path(args.plans).glob("*.json")):
            plan = Plan.load(path)
            backend.compile(graph, plan)  # validates against this graph and machine
            fns[path.stem] = (lambda p: lambda: backend.execute(graph, p, inputs))(plan)
        if not fns:
            raise RuntimeError(f"no plans in {args.plans}")
        info["pinned_note"] = getattr(backend, "_pin_note", None)
        return fns, info

    raise RuntimeError(f"unknown kind {args.kind!r}")


def build_train_step(args: argparse.Namespace) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """Training-step kinds (one full step per call: forward, loss, backward, the optimizer's update),
    on zoo model ``--model`` at ``--batch`` / ``--width`` with ``--optimizer`` (SGD with momentum
    by default), every kind from the same seed:

    * ``train-eager`` / ``train-eager-1t``: ``zero_grad``, forward, loss, ``backward``, ``step`` at
      PyTorch's default threads / after ``torch.set_num_threads(1)``;
    * ``train-compile``: the same with ``torch.compile(module)`` (inductor; forward and backward
      compiled, the optimizer eager), compiled at start-up;
    * ``train-opsched``: the captured step run on opsched's executor under ``--policy``'s plan
      (a heuristic's name), the planning model this machine's (``opsched profile`` if cached);
    * ``train-step``: ``opsched.train_step(--policy or the shipped policy, ...)`` as a user calls it:
      planned, its candidates timed here, checked against eager - what the product runs."""
    import torch

    from opsched.adapters.train import TrainingNetwork, eager_step
    from opsched.specs import load_training

    info: dict[str, Any] = {}
    if args.kind == "train-eager-1t":
        torch.set_num_threads(1)
    net, x, y = load_training(f"zoo:{args.model}", args.batch, args.width, optimizer=args.optimizer)
    info["torch_threads"] = torch.get_num_threads()
    if args.kind in ("train-eager", "train-eager-1t"):
        return {args.kind: lambda: eager_step(net, x, y)}, info
    if args.kind == "train-compile":
        compiled = TrainingNetwork(torch.compile(net.module), net.loss_fn, net.optimizer)
        t0 = time.perf_counter()
        eager_step(compiled, x, y)
        eager_step(compiled, x, y)  # the backward graph compiles on the first backward
        info["compile_s"] = time.perf_counter() - t0
        return {"train-compile": lambda: eager_step(compiled, x, y)}, info
    if args.kind in ("train-opsched", "train-step"):
        import warnings

        import opsched
        from opsched.scheduled import ScheduleFallbackWarning

        measure = 0 if args.kind == "train-opsched" else 3
        policy = args.policy or None
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ScheduleFallbackWarning)
            step = opsched.train_step(policy, net.module, net.loss_fn, net.optimizer, x, y, measure=measure)
        info["setup_s"] = time.perf_counter() - t0
        info["fallback"] = step.fallback_reason or ("; ".join(str(w.message) for w in caught) or None)
        info["plan"] = step.plan.policy if step.plan is not None else None
        info["chosen"] = step.plan.meta.get("chosen") if step.plan is not None else None
        info["threads"] = sorted({a.threads for a in step.plan.assignments.values()}) if step.plan else None
        info["busy_cores"] = step.machine.cpu.busy_cores
        info["ops"] = len(step.graph.ops) if step.graph is not None else None
        return {args.kind: lambda: step(x, y)}, info
    raise RuntimeError(f"unknown kind {args.kind!r}")


def main(argv: list[str] | None = None) -> None:
    """Protocol: stdout carries JSON lines only (the real stdout is duplicated for
    it and fd 1 pointed at stderr, so library prints cannot corrupt it).  First
    ``{"ready": true, "configs": [...], "init_s": ..., ...}`` or ``{"error": ...}``;
    then for each request ``{"cmd": "time", "name": N, "iters": k}`` the answer
    ``{"times": [seconds per call, ...]}``; ``{"cmd": "quit"}`` ends it.  With
    ``--check FILE`` the first output tensor (flattened, float32) of every
    configuration is saved to ``FILE`` (``.npz``, one array per configuration)
    so the driver can compare it with eager's."""
    from opsched.benchmarks.harness import doc_summary

    ap = argparse.ArgumentParser(prog="python -m opsched.benchmarks.real_worker",
                                 description=doc_summary(__doc__))
    ap.add_argument("--kind", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--optimizer", default="sgd", help="train-* kinds: sgd, adam or adamw")
    ap.add_argument("--onnx", default="")
    ap.add_argument("--plans", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--check", default="")
    ap.add_argument("--policy", default="", help="opsched-ort: the policy folder (default: the shipped one)")
    ap.add_argument("--profiles", default="", help="opsched-ort: the profile cache (default runs/profiles)")
    args = ap.parse_args(argv)
    _take_stdout()
    t0 = time.perf_counter()
    try:
        fns, info = build(args)
        if args.check:
            import numpy as np

            outs = {name: first_tensor(fn()) for name, fn in fns.items()}
            np.savez(args.check, **{k: v for k, v in outs.items() if v is not None})
    except BaseException as exc:  # report, never hang the driver
        traceback.print_exc()
        say({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"})
        return
    say({"ready": True, "configs": list(fns), "init_s": time.perf_counter() - t0, **info})
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            say({"error": f"bad request {line[:80]!r}"})
            return
        if req.get("cmd") == "quit":
            return
        if req.get("cmd") == "rss_reset":  # from now on: free the heap's unused pages, reset the peak
            say({"rss_mb": reset_peak_rss()})
            continue
        if req.get("cmd") == "rss":  # peak resident memory since the last reset (VmHWM)
            say({"peak_rss_mb": peak_rss_mb()})
            continue
        try:
            fn = fns[req["name"]]
            times = []
            for _ in range(int(req.get("iters", 1))):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            say({"times": times})
        except BaseException as exc:
            traceback.print_exc()
            say({"error": f"{req.get('name')}: {type(exc).__name__}: {exc}"[:500]})
            return


if __name__ == "__main__":
    main()
