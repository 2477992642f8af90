"""``opsched graphs``: the built-in graphs - the zoo (and optionally the
synthetic families) with their op counts, FLOPs, parallel width and depth."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opsched.cli import app


@app.command("graphs")
def graphs_cmd(
    names: list[str] = typer.Argument(None, help="Zoo models to show (default: all)."),
    batch: int = typer.Option(1, "--batch", "-b", min=1, help="Batch size of the zoo models."),
    width: float = typer.Option(1.0, "--width", "-w", min=0.01, help="Channel / hidden-size multiplier."),
    seed: int = typer.Option(0, "--seed", help="Seed for weights, RandWire wiring and synthetic graphs."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Add one row per synthetic family."),
    n_ops: int = typer.Option(200, "--n", min=1, help="Op count of the synthetic graphs."),
    save: Path = typer.Option(None, "--save", help="Write each graph as DIR/<name>.json."),
) -> None:
    """List the built-in graphs: ops, edges, GFLOPs, parallel width (max antichain) and depth."""
    from opsched.synthetic import FAMILIES, generate
    from opsched.zoo import ZOO, get_zoo_model

    chosen = [get_zoo_model(n) for n in names] if names else list(ZOO.values())
    console = Console()
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("importing", total=len(chosen) + (len(FAMILIES) if synthetic else 0))
        for z in chosen:
            progress.update(task, description=f"importing {z.name}")
            rows.append((z.name, z.description, z.graph(batch, width, seed)))
            progress.advance(task)
        if synthetic:
            for fam in FAMILIES:
                progress.update(task, description=f"generating {fam}")
                g = generate(fam, n_ops, seed)
                rows.append((g.name, f"synthetic {fam} DAG, {n_ops} ops, seed {seed}", g))
                progress.advance(task)

    table = Table(title=f"opsched graphs (batch {batch}, width {width:g})")
    table.add_column("name", no_wrap=True)
    table.add_column("description", ratio=1)
    for col in ("ops", "edges", "GFLOPs", "width", "depth"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, desc, g in rows:
        s = g.summary()
        table.add_row(name, desc, str(s["ops"]), str(s["edges"]), f"{s['gflops']:.3f}", str(s["width"]),
                      str(s["depth"]))
    console.print(table)
    console.print("[dim]width: the largest set of ops no path connects (parallelism to exploit); "
                  "depth: ops on the longest chain[/dim]")
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        for name, _, g in rows:
            g.save(save / f"{name}.json")
        console.print(f"saved {len(rows)} graphs to {save}/")
