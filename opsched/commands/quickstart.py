"""``opsched quickstart``: the README's main job, on the embedded defaults.

It runs what a new user would run by hand, in order, on built-in graphs only
(no download, no server, no GPU):

1. ``opsched machine`` — what this machine is;
2. ``opsched train-policy`` — a short training run in the simulator (the
   ``quick`` budget below; the full default run is ``opsched train-policy``);
3. ``opsched compare`` — every heuristic and the freshly trained policy on the
   zoo in the simulator on the 68-core ``knl-68`` preset, with tables, a
   speed-up chart and Gantt charts under ``runs/compare_<N>/``;
4. ``opsched apply`` — the shipped pretrained policy plans a real model, which
   then runs on this machine's cores next to eager PyTorch, outputs checked.

Each step is the public command itself (called through the same typer app),
so what quickstart prints is exactly what those commands print.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.rule import Rule

from opsched.cli import app
from opsched.policies.exported import pretrained_path

#: The zoo graphs quickstart compares on.
QUICK_GRAPHS = "zoo:inception,zoo:nasnet,zoo:randwire,zoo:lstm"


def _newest_run(out: Path, name: str) -> Path | None:
    runs = [p for p in out.glob(f"{name}_*") if p.is_dir() and p.name.rsplit("_", 1)[-1].isdigit()]
    return max(runs, key=lambda p: int(p.name.rsplit("_", 1)[-1]), default=None)


@app.command("quickstart")
def quickstart(
    timesteps: int = typer.Option(2048, "--timesteps", help="PPO steps of the short training run (0 skips it)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Folder for the run folders."),
    machine: str = typer.Option("knl-68", "--machine", help="Preset the simulator comparison runs on."),
    real_model: str = typer.Option("zoo:randwire", "--real-model", help="Model `apply` runs for real here."),
) -> None:
    """Run the main job end to end: train briefly, compare with the heuristics, apply for real."""
    console = Console()

    def step(title: str, args: list[str]) -> None:
        console.print(Rule(f"[bold]{title}[/bold]"))
        console.print(f"[dim]$ opsched {' '.join(args)}[/dim]")
        app(args, standalone_mode=False)

    step("1/4  this machine", ["machine"])
    policies = "all"
    if timesteps > 0:
        step("2/4  train a policy (short run in the simulator)",
             ["train-policy", "--name", "quickstart", "--timesteps", str(timesteps), "--hyperparams", "quick",
              "--out", str(out)])
        run = _newest_run(out, "quickstart")
        if run is not None and (run / "policy" / "policy.json").exists():
            policies = f"all,{run / 'policy'}"
    pretrained = pretrained_path()
    if (pretrained / "policy.json").exists():
        policies = f"{policies},{pretrained}"
    step(f"3/4  compare on the zoo in the simulator ({machine})",
         ["compare", "--graphs", QUICK_GRAPHS, "--machine", machine, "--backend", "sim", "--policies", policies,
          "--out", str(out)])
    step("4/4  apply the pretrained policy to a real model on this machine",
         ["apply", "--model", real_model, "--batch", "1", "--repeats", "5"])
    console.print(Rule())
    console.print(f"Done. Results are under {out}/ (compare_<N>/ has the tables, speedup.png and Gantt charts).")
