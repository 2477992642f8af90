"""``opsched bench``: the full benchmark report (:mod:`opsched.benchmarks.run_all`).

Options map one to one onto ``python -m opsched.benchmarks.run_all``'s flags;
the harness is part of the installed package, so this works from any folder.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from opsched.benchmarks.run_all import SECTIONS
from opsched.commands.app import app


@app.command("bench")
def bench_cmd(
    quick: bool = typer.Option(False, "--quick", help="Smoke run (<= 5 min): fewer models, batch 1, few repeats."),
    out: str = typer.Option("runs", "--out", help="Folder that receives bench_<N>/."),
    sections: str = typer.Option("", "--sections", help=f"Comma-separated subset of {','.join(SECTIONS)} (default all)."),
    models: str = typer.Option("", "--models", help="Zoo models for the real and fidelity sections."),
    batches: str = typer.Option("", "--batches", help="Batch sizes for the real section (default 1,8)."),
    rounds: int = typer.Option(0, "--rounds", help="Interleaved timing rounds (default 7; quick 3)."),
    policy: str = typer.Option("", "--policy", help="Exported learned policy folder ('none' to leave it out)."),
    search_trials: int = typer.Option(0, "--search-trials", help="Optuna search budget per graph."),
    no_compile: bool = typer.Option(False, "--no-compile", help="Leave torch.compile out."),
    profile: bool = typer.Option(False, "--profile", help="Profile zoo models that have no cached profile first."),
    profiles: str = typer.Option("", "--profiles", help="Profile cache opsched plans with (default: the per-user cache, `opsched cache --path`)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars."),
) -> None:
    """Benchmark opsched against eager PyTorch, torch.compile, ONNX Runtime, TensorFlow and the lower bound."""
    argv: list[str] = ["--out", out]
    for flag, value in (("--sections", sections), ("--models", models), ("--batches", batches),
                        ("--policy", policy), ("--profiles", profiles)):
        if value:
            argv += [flag, value]
    for flag, value in (("--rounds", rounds), ("--search-trials", search_trials)):
        if value:
            argv += [flag, str(value)]
    for flag, on in (("--quick", quick), ("--no-compile", no_compile), ("--profile", profile),
                     ("--no-progress", not progress)):
        if on:
            argv.append(flag)
    typed = sys.argv[1:] if Path(sys.argv[0]).name == "opsched" and sys.argv[1:2] == ["bench"] else ["bench", *argv]
    from opsched.benchmarks import run_all

    try:
        run_all.main(argv, command=shlex.join(["opsched", *typed]))
    except SystemExit as exc:  # the script's own usage errors: already printed, keep the status
        if exc.code not in (0, None):
            raise typer.Exit(exc.code if isinstance(exc.code, int) else 2) from None
