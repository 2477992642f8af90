"""``opsched profile MODEL``: measure a model's ops and this machine's runtime, for planning.

Two steps, both cached under ``--out`` (default: the per-user cache's
``profiles/``, ``opsched cache --path``) and reused by
every later plan on this machine (:func:`opsched.planning.planning_model`):

1. every op alone at 1, 2, 4 ... threads, plus co-run pairs
   (:func:`opsched.backends.profiler.profile_graph`) - the performance model;
2. a set of whole plans of the model run on the PyTorch CPU runtime, and the
   runtime model refitted on every such measurement of this machine
   (:func:`opsched.backends.runtime_fit.calibrate`) - what the runtime adds
   (hand-offs, OpenMP spin windows and teams, in-situ op costs).

The command prints the slowest ops, how they scale, the runtime model and
how well the planning model now predicts this model's measured plans.

``--backend ort`` does both for ONNX Runtime instead (:mod:`opsched.backends.ort_profiler`,
:mod:`opsched.backends.ort_fit`): the graph ONNX Runtime runs (a PyTorch model
exported to ONNX first, or an ``.onnx`` file), every node's kernel time from
ONNX Runtime's own profiler at each thread level, co-run pairs, then plans
measured on the ``ort`` backend; cached in ``<out>/ort`` and
``<out>/runtime/<machine>/ort.json``.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from opsched.commands.app import app, console_for, progress_option, want_progress


@app.command("profile")
def profile_cmd(
    model_arg: str = typer.Argument(None, metavar="[MODEL]", help="The network (same as --model)."),
    model: str = typer.Option(None, "--model", "-m", help="The network: zoo:NAME or path/to/module.py:factory "
                              "(a torch model), or path/to/model.onnx (--backend ort)."),
    backend: str = typer.Option("torch-cpu", "--backend", help="Whose kernels to profile and whose runtime to "
                                "fit: torch-cpu (PyTorch's ops) or ort (ONNX Runtime's kernels and the ort "
                                "backend)."),
    batch: int = typer.Option(1, "--batch", "-b", min=1, help="Batch size."),
    width: float = typer.Option(1.0, "--width", min=0.01, help="Channel / hidden-size multiplier."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights."),
    refresh: bool = typer.Option(False, "--refresh", help="Measure again even when a cached profile exists."),
    repeats: int = typer.Option(30, "--repeats", "-r", min=1, help="Most timed calls per op and thread count "
                                "(slow ops get fewer, down to 5)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed calls per op and thread count first."),
    threads: str = typer.Option(None, "--threads", help="Thread counts to measure, e.g. '1,2' "
                                "(default: 1, 2, 4, ... up to this machine's cores)."),
    no_interference: bool = typer.Option(False, "--no-interference", help="Skip the co-run pair measurements."),
    runtime: bool = typer.Option(True, "--runtime/--no-runtime", help="Also measure whole plans and refit this "
                                 "machine's runtime model (about a minute; needs a PyTorch model)."),
    runtime_plans: int = typer.Option(16, "--runtime-plans", min=4, help="Plans measured for the runtime model."),
    out: Path = typer.Option(None, "--out", "-o", help="Profile cache folder (default: the per-user cache's "
                             "profiles/, where every command plans from; `opsched cache --path`).",
                             show_default=False),
    top: int = typer.Option(15, "--top", min=1, help="How many ops to list."),
    mode: str = typer.Option("infer", "--mode", help="infer (the network's ops) or train (the ops of its training "
                             "step: forward, backward and the optimizer update, torch-cpu)."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="Train mode: sgd, adam or adamw."),
    cluster: str = typer.Option(None, "--cluster", help="Profile every distinct machine of a Ray cluster on its "
                                "own nodes (ray or ray:ADDRESS) and gather the profiles here, keyed by each "
                                "machine's fingerprint (needs opsched[cluster]; torch-cpu only)."),
    progress: bool | None = progress_option(),
) -> None:
    """Profile each op of MODEL alone on real tensors at 1, 2, 4, ... threads, then fit the runtime model on
    measured plans (both cached and used by every later plan on this machine)."""
    from opsched.backends.profiler import profile_graph
    from opsched.engine.profiles import cache_path
    from opsched.errors import OpschedError
    from opsched.machine import Machine
    from opsched.specs import load_graph

    spec = model or model_arg
    if not spec:
        raise OpschedError("profile: name the network, e.g. `opsched profile zoo:resnet50` (or --model)")
    if model and model_arg and model != model_arg:
        raise OpschedError(f"profile: two networks named ({model_arg!r} and --model {model!r}); give one")
    console = console_for()
    levels = None
    if threads:
        try:
            levels = [int(x) for x in threads.split(",") if x.strip()]
        except ValueError:
            raise OpschedError(f"--threads {threads!r}: expected comma-separated integers such as 1,2") from None
    from opsched.cache import profiles_dir

    out = profiles_dir(out)
    if mode not in ("infer", "train"):
        raise OpschedError(f"profile: --mode must be infer or train, got {mode!r}")
    if mode == "train" and (backend != "torch-cpu" or cluster):
        raise OpschedError("profile --mode train: training steps are profiled on torch-cpu, on this machine")
    if cluster:
        if backend != "torch-cpu":
            raise OpschedError(f"profile --cluster: --backend {backend} is not supported on a cluster (torch-cpu is)")
        from opsched.commands.cluster_profile import profile_on_cluster

        profile_on_cluster(console, cluster, spec, batch, width, seed, levels, warmup, repeats, not no_interference,
                           runtime, runtime_plans, refresh, out)
        return
    machine = Machine.probe()
    if backend not in ("torch-cpu", "ort"):
        raise OpschedError(f"profile: --backend must be torch-cpu or ort, got {backend!r}")
    if backend == "ort":
        _profile_ort(console, spec, batch, width, seed, machine, levels, refresh, not no_interference, runtime,
                     runtime_plans, out, top, progress)
        return
    with console.status(f"importing {spec}" + (" (training step)" if mode == "train" else "")):
        if mode == "train":
            from opsched.importers.torch_step import capture_step
            from opsched.specs import load_training

            net, x, y = load_training(spec, batch, width, seed, optimizer=optimizer)
            graph = capture_step(net.module, net.loss_fn, net.optimizer, x, y, name=f"{spec}:train")
        else:
            graph = load_graph(spec, batch=batch, width=width, seed=seed)
    path = cache_path(graph, machine, out)
    before = path.stat().st_mtime_ns if path.exists() else None
    prof = profile_graph(graph, machine, threads=levels, warmup=warmup, repeats=repeats, refresh=refresh,
                         cache_dir=out, interference=not no_interference, progress=want_progress(progress),
                         console=console_for(stderr=True))
    _print_profile(console, graph, machine, prof, top)
    reused = before is not None and path.exists() and path.stat().st_mtime_ns == before
    state = "reused the cached profile (--refresh to measure again)" if reused else "profile written to"
    console.print(f"{state} [bold]{path}[/bold]")
    if runtime and mode == "train":
        console.print("[yellow]runtime model: fitted on inference plans only; the training step is planned with the "
                      "runtime model of its executor (profile an inference graph with --runtime)[/yellow]")
    elif runtime:
        _calibrate(console, spec, graph, batch, width, seed, machine, out, runtime_plans, progress)


def _print_profile(console, graph, machine, prof, top: int) -> None:  # noqa: ANN001
    lo, hi = min(prof.levels), max(prof.levels)
    table = Table(title=f"{graph.name}: {len(graph.ops)} ops on {machine.name} "
                        f"({machine.cpu.cores} cores), top {min(top, len(graph.ops))} by time at {lo} thread(s)")
    table.add_column("op", no_wrap=True)
    table.add_column("kind")
    for k in prof.levels:
        table.add_column(f"{k} thr (µs)", justify="right")
    table.add_column("IQR", justify="right")
    table.add_column(f"speed-up {lo}->{hi}", justify="right")
    for p in sorted(prof.ops.values(), key=lambda p: -p.median[lo])[:top]:
        q25, q75 = p.quartiles[lo]
        table.add_row(p.id, p.kind, *(f"{p.median[k] * 1e6:.1f}" for k in prof.levels),
                      f"{(q75 - q25) / p.median[lo]:.0%}", f"{p.speedup(hi):.2f}x")
    console.print(table)
    totals = "   ".join(f"{k} thr: {prof.total_time(k) * 1e3:.2f} ms" for k in prof.levels)
    console.print(f"sum of op times   {totals}   (speed-up {prof.total_time(lo) / prof.total_time(hi):.2f}x)")
    contended = sum(p.others_cores > 0.25 for p in prof.ops.values())
    if contended:
        console.print(f"[yellow]{contended} of {len(prof.ops)} ops were measured while other processes used "
                      "more than a quarter of a core; their multi-thread times are pessimistic, and a profile "
                      "measured mostly under load is not planned with - re-run with --refresh on a quieter "
                      "machine[/yellow]")
    inter = prof.interference
    if inter and inter.get("fit"):
        fit = inter["fit"]
        factors = ", ".join(f"{k} {v:.2f}x" for k, v in inter.get("class_factors", {}).items())
        console.print(f"co-run slowdown ({fit['n_pairs']} pairs): {factors}; fitted c0={fit['c0']:.3f} "
                      f"gamma={fit['gamma']:.2f} B={fit['bandwidth_gbs']:.1f} GB/s")


def _calibrate(console, spec: str, graph, batch: int, width: float, seed: int, machine, out: Path,  # noqa: ANN001
               n_plans: int, progress: bool | None) -> None:
    """Step 2: measure whole plans, refit and save the runtime model, show how well it predicts them."""
    from opsched.backends.runtime_fit import GraphRef

    if graph.source is None or type(graph.source).__name__ != "TorchSource":
        console.print("[yellow]runtime model: skipped (it is fitted on a PyTorch model's measured plans)[/yellow]")
        return
    _fit_runtime(console, "torch-cpu", graph, GraphRef(spec, batch, width, seed), machine, out, n_plans, progress)


def _profile_ort(console, spec: str, batch: int, width: float, seed: int, machine, levels, refresh: bool,  # noqa: ANN001
                 interference: bool, runtime: bool, n_plans: int, out: Path, top: int, progress: bool | None) -> None:
    """``--backend ort``: ONNX Runtime's kernel profile, then the ort runtime model."""
    from opsched.backends.ort_profiler import ort_cache_dir, profile_ort
    from opsched.backends.runtime_fit import GraphRef
    from opsched.engine.profiles import cache_path
    from opsched.specs import load_onnx_graph

    with console.status(f"importing {spec} into ONNX Runtime"):
        graph = load_onnx_graph(spec, batch=batch, width=width, seed=seed)
    folder = ort_cache_dir(out)
    with console.status(f"profiling {graph.name} with ONNX Runtime's profiler") as status:
        prof = profile_ort(graph, machine, threads=levels, refresh=refresh, cache_dir=folder,
                           interference=interference, progress=lambda msg: status.update(msg))
    _print_profile(console, graph, machine, prof, top)
    console.print(f"ONNX Runtime profile in [bold]{cache_path(graph, machine, folder)}[/bold]")
    if not runtime:
        return
    _fit_runtime(console, "ort", graph, GraphRef(spec, batch, width, seed), machine, out, n_plans, progress)


def _fit_runtime(console, backend: str, graph, ref, machine, out: Path, n_plans: int,  # noqa: ANN001
                 progress: bool | None) -> None:
    """Measure ``n_plans`` whole plans of ``graph`` on ``backend``, refit and save
    the backend's runtime model, and show how well the planning model then
    predicts those plans (in-sample)."""
    import numpy as np

    from opsched.backends.runtime_fit import runtime_path, simulate
    from opsched.engine.models.runtime import PlanningModel
    from opsched.planning import planning_model
    from opsched.progress import progress_bar

    if backend == "ort":
        from opsched.backends.ort_fit import calibrate_ort as calibrate
    else:
        from opsched.backends.runtime_fit import calibrate
    cpu = machine.cpu_only()
    perf = planning_model(cpu, backend, "fitted", out)
    perf = perf.perf if isinstance(perf, PlanningModel) else perf
    rounds = 3
    with progress_bar(console=console_for(stderr=True), enabled=want_progress(progress), transient=True,
                      eta=False) as bar:
        task = bar.add_task(f"{backend} runtime: measuring {n_plans} plans of {graph.name}", total=rounds)
        model, runs = calibrate(graph, ref, cpu, perf, n_plans=n_plans, rounds=rounds, cache_dir=out,
                                on_round=lambda r: bar.update(task, completed=r))
    mine = next(r for r in runs if r.graph.fingerprint() == graph.fingerprint())
    sims = simulate(mine.graph, cpu, PlanningModel(perf, model), mine.plans)
    err = np.array([abs(sims[p] - mine.measured(p)) / mine.measured(p) for p in mine.plans])
    fields = ", ".join(f"{k}={v:.3g}" for k, v in model.to_dict().items() if k not in ("backend", "fitted_on"))
    console.print(f"{backend} runtime model (fitted on {len(runs)} model(s), {sum(len(r.plans) for r in runs)} "
                  f"plans): {fields}")
    console.print(f"planning model vs {len(mine.plans)} measured plans of {graph.name}: median error "
                  f"{np.median(err):.1%} (in-sample: these plans were fitted on)")
    console.print(f"runtime model written to [bold]{runtime_path(cpu, backend, out)}[/bold]")
