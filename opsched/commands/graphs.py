"""``opsched graphs``: the built-in graphs - the zoo (and optionally the
synthetic families) with their op counts, FLOPs, parallel width and depth."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from opsched.commands.app import app, console_for, progress_option, want_progress
from opsched.progress import progress_bar
from opsched.synthetic import FAMILIES
from opsched.zoo import ZOO


@app.command("graphs")
def graphs_cmd(
    names: list[str] = typer.Argument(None, show_default=False,
                                      help=f"Zoo models to show: {', '.join(ZOO)} (default: all)."),
    batch: int = typer.Option(1, "--batch", "-b", min=1, help="Batch size of the zoo models."),
    width: float = typer.Option(1.0, "--width", "-w", min=0.01, help="Channel / hidden-size multiplier."),
    seed: int = typer.Option(0, "--seed", help="Seed for weights, RandWire wiring and synthetic graphs."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Add one row per synthetic family: "
                                   f"{', '.join(FAMILIES)}."),
    n_ops: int = typer.Option(200, "--n", min=1, help="Op count of the synthetic graphs."),
    save: Path = typer.Option(None, "--save", show_default=False, help="Write each graph as DIR/<name>.json (default: not saved)."),
    progress: Optional[bool] = progress_option(),
) -> None:
    """List the built-in graphs: ops, edges, GFLOPs, parallel width (max antichain) and depth."""
    from opsched.synthetic import generate
    from opsched.zoo import get_zoo_model

    chosen = [get_zoo_model(n) for n in names] if names else list(ZOO.values())
    console = console_for()
    rows = []
    with progress_bar(console=console_for(stderr=True), enabled=want_progress(progress), transient=True,
                      eta=False) as bar:
        task = bar.add_task("importing", total=len(chosen) + (len(FAMILIES) if synthetic else 0))
        for z in chosen:
            bar.update(task, description=f"importing {z.name}")
            rows.append((z.name, z.description, z.graph(batch, width, seed)))
            bar.advance(task)
        if synthetic:
            for fam in FAMILIES:
                bar.update(task, description=f"generating {fam}")
                g = generate(fam, n_ops, seed)
                rows.append((g.name, f"synthetic {fam} DAG, {n_ops} ops, seed {seed}", g))
                bar.advance(task)

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
