"""``opsched export RUN``: a trained run's policy as a numpy-only scheduler folder."""

from __future__ import annotations

from pathlib import Path

import typer

from opsched.commands.app import app, console_for


@app.command("export")
def export_cmd(
    run: Path = typer.Argument(..., help="Training run folder (runs/<name>_<N>)."),
    which: str = typer.Option("best", "--which", help="Which model: best (the best validation model), final (the "
                              "last), or the path of a model zip inside the run."),
    out: Path = typer.Option(None, "--out", "-o", show_default=False,
                             help="Output folder (default: <run>/policy)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check the numpy scheduler's logits "
                                "against the torch policy's after writing."),
) -> None:
    """Write RUN/policy/ (policy.json + weights.npz): plans with numpy only, no torch or SB3 needed."""
    from opsched.agents.export import export_run
    from opsched.policies.exported import load

    folder = export_run(run, which=which, out=out, verify=verify)
    pol = load(folder)
    arch, src = pol.meta["architecture"], pol.meta["source"]
    console = console_for()
    console.print(f"exported [bold]{src.get('model', '?')}[/bold] of {run} ({src.get('num_timesteps', '?')} steps) "
                  f"to [bold]{folder}[/bold]: graph encoder hidden={arch['hidden']} rounds={arch['rounds']}, "
                  f"max_nodes={pol.max_nodes}" + (", verified against the torch policy" if verify else ""))
    console.print(f"use it: opsched apply --policy {folder} --model zoo:nasnet")
