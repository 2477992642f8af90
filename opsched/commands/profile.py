"""``opsched profile MODEL``: time every op of a model alone at each thread count.

Runs :func:`opsched.backends.profiler.profile_graph` with a progress bar,
prints the ops that take longest and how they scale from 1 to the most
threads, and says where the cached profile is (reused next time unless
``--refresh``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from opsched.cli import app


@app.command("profile")
def profile_cmd(
    model: str = typer.Argument(..., help="Model spec: zoo:NAME, path/to/module.py:factory (a torch model)."),
    batch: int = typer.Option(1, "--batch", "-b", min=1, help="Batch size."),
    width: float = typer.Option(1.0, "--width", "-w", min=0.01, help="Channel / hidden-size multiplier."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights."),
    refresh: bool = typer.Option(False, "--refresh", help="Measure again even when a cached profile exists."),
    repeats: int = typer.Option(30, "--repeats", "-r", min=1, help="Most timed calls per op and thread count "
                                "(slow ops get fewer, down to 5)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed calls per op and thread count first."),
    threads: str = typer.Option(None, "--threads", help="Thread counts to measure, e.g. '1,2' "
                                "(default: 1, 2, 4, ... up to this machine's cores)."),
    no_interference: bool = typer.Option(False, "--no-interference", help="Skip the co-run pair measurements."),
    out: Path = typer.Option(Path("runs/profiles"), "--out", "-o", help="Profile cache folder."),
    top: int = typer.Option(15, "--top", min=1, help="How many ops to list."),
) -> None:
    """Profile each op of MODEL alone on real tensors at 1, 2, 4, ... threads (cached)."""
    from opsched.backends.profiler import cache_path, profile_graph
    from opsched.errors import OpschedError
    from opsched.machine import Machine
    from opsched.models import load_graph

    console = Console()
    levels = None
    if threads:
        try:
            levels = [int(x) for x in threads.split(",") if x.strip()]
        except ValueError:
            raise OpschedError(f"--threads {threads!r}: expected comma-separated integers such as 1,2") from None
    machine = Machine.probe()
    with console.status(f"importing {model}"):
        graph = load_graph(model, batch=batch, width=width, seed=seed)
    path = cache_path(graph, machine, out)
    before = path.stat().st_mtime_ns if path.exists() else None
    prof = profile_graph(graph, machine, threads=levels, warmup=warmup, repeats=repeats, refresh=refresh,
                         cache_dir=out, interference=not no_interference, console=console)
    lo, hi = min(prof.levels), max(prof.levels)

    table = Table(title=f"{graph.name}: {len(graph.ops)} ops on {machine.name} "
                        f"({machine.cpu.cores} cores), top {min(top, len(graph.ops))} by time at {lo} thread(s)")
    table.add_column("op", no_wrap=True)
    table.add_column("kind")
    for k in prof.levels:
        table.add_column(f"{k} thr (µs)", justify="right")
    table.add_column("IQR", justify="right")
    table.add_column(f"speed-up {lo}->{hi}", justify="right")
    ranked = sorted(prof.ops.values(), key=lambda p: -p.median[lo])
    for p in ranked[:top]:
        q25, q75 = p.quartiles[lo]
        table.add_row(p.id, p.kind, *(f"{p.median[k] * 1e6:.1f}" for k in prof.levels),
                      f"{(q75 - q25) / p.median[lo]:.0%}", f"{p.speedup(hi):.2f}x")
    console.print(table)
    totals = "   ".join(f"{k} thr: {prof.total_time(k) * 1e3:.2f} ms" for k in prof.levels)
    console.print(f"sum of op times   {totals}   (speed-up {prof.total_time(lo) / prof.total_time(hi):.2f}x)")
    contended = sum(p.others_cores > 0.25 for p in prof.ops.values())
    if contended:
        console.print(f"[yellow]{contended} of {len(prof.ops)} ops were measured while other processes used "
                      "more than a quarter of a core; their multi-thread times are pessimistic - re-run with "
                      "--refresh on a quieter machine[/yellow]")
    inter = prof.interference
    if inter and inter.get("fit"):
        fit = inter["fit"]
        factors = ", ".join(f"{k} {v:.2f}x" for k, v in inter.get("class_factors", {}).items())
        console.print(f"co-run slowdown ({fit['n_pairs']} pairs): {factors}; fitted c0={fit['c0']:.3f} "
                      f"gamma={fit['gamma']:.2f} B={fit['bandwidth_gbs']:.1f} GB/s")
    reused = before is not None and path.exists() and path.stat().st_mtime_ns == before
    state = "reused the cached profile (--refresh to measure again)" if reused else "profile written to"
    console.print(f"{state} [bold]{path}[/bold]")
