"""``opsched quickstart``: the README's main job, on the embedded defaults.

It runs what a new user would run by hand, in order, on built-in graphs only
(no download, no server, no GPU):

1. ``opsched machine`` — what this machine is;
2. ``opsched train-policy`` — a short training run in the simulator (the
   ``quick`` hyperparameters on a few synthetic graphs and machines of the
   training family; the full default run is ``opsched train-policy``);
3. ``opsched compare`` — every heuristic and the freshly trained policy on the
   zoo in the simulator on the 68-core ``knl-68`` preset, with tables, a
   speed-up chart and Gantt charts under ``runs/compare_<N>/``;
4. ``opsched apply`` — the shipped pretrained policy plans a real model, which
   then runs on this machine's cores next to eager PyTorch, outputs checked.

Each step is the public command itself (called through the same typer app),
so what quickstart prints is exactly what those commands print; ``--progress``
or ``--no-progress``, when given, is passed on to each step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.rule import Rule

from opsched.commands.app import app, console_for, progress_option
from opsched.machine import MACHINE_SPECS
from opsched.policies.exported import pretrained_path

#: The zoo graphs quickstart compares on.
QUICK_GRAPHS = "zoo:inception,zoo:nasnet,zoo:randwire,zoo:lstm"
#: The short training run's sets (spec strings of opsched.specs): synthetic graphs and
#: draws of the training machine family, validated on others (agents/splits.py's kinds).
QUICK_TRAIN = ("train_graphs=layered:40:1,erdos_renyi:60:2,watts_strogatz:40:3,matmul_chains:30:1",
               "train_machines=random:0,random:1,random:2,random:3,random:4,random:5",
               "validation_graphs=layered:60:101,transformer:60:105", "validation_machines=random:1000,random:1001")


def _newest_run(out: Path, name: str) -> Path | None:
    runs = [p for p in out.glob(f"{name}_*") if p.is_dir() and p.name.rsplit("_", 1)[-1].isdigit()]
    return max(runs, key=lambda p: int(p.name.rsplit("_", 1)[-1]), default=None)


@app.command("quickstart")
def quickstart(
    train: bool = typer.Option(True, "--train/--no-train", help="Train a policy briefly first (about 30 s)."),
    out: Path = typer.Option(Path("runs"), "--out", help="Folder for the run folders."),
    machine: str = typer.Option("knl-68", "--machine", help=f"The machine the simulator comparison runs on: "
                                f"{MACHINE_SPECS}."),
    model: str = typer.Option("zoo:randwire", "--model", "-m", help="The network `apply` runs for real on this "
                              "machine: zoo:NAME, keras:NAME or path/to/module.py:factory."),
    progress: Optional[bool] = progress_option(),
) -> None:
    """Run the main job end to end: train briefly, compare with the heuristics, apply for real."""
    console = console_for()
    shown = [] if progress is None else ["--progress" if progress else "--no-progress"]

    def step(title: str, args: list[str]) -> None:
        console.print(Rule(f"[bold]{title}[/bold]"))
        console.print(f"[dim]$ opsched {' '.join(args)}[/dim]")
        app(args, standalone_mode=False)

    step("1/4  this machine", ["machine"])
    policies = "all"
    if train:
        sets = [x for item in QUICK_TRAIN for x in ("--set", item)]
        step("2/4  train a policy (short run in the simulator)",
             ["train-policy", "--name", "quickstart", "--hyperparams", "quick", "--timesteps", "0", *sets,
              "--out", str(out), *shown])
        run = _newest_run(out, "quickstart")
        if run is not None and (run / "policy" / "policy.json").exists():
            policies = f"all,{run / 'policy'}"
    pretrained = pretrained_path()
    if (pretrained / "policy.json").exists():
        policies = f"{policies},{pretrained}"
    step(f"3/4  compare on the zoo in the simulator ({machine})",
         ["compare", "--model", QUICK_GRAPHS, "--machine", machine, "--backend", "sim", "--policies", policies,
          "--out", str(out), *shown])
    step("4/4  apply the pretrained policy to a real model on this machine",
         ["apply", "--model", model, "--batch", "1", "--repeats", "5", *shown])
    console.print(Rule())
    console.print(f"Done. Results are under {out}/ (compare_<N>/ has the tables, speedup.png and Gantt charts).")
