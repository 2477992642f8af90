"""``opsched bench``: a thin wrapper around ``bench/run_all.py`` (the one benchmark command).

The benchmark lives in the repository's ``bench/`` folder, beside the package
(it is a measurement script, not library code), so this command needs a
source checkout; it says so clearly when ``bench/run_all.py`` is not there.
Options map one to one onto the script's flags.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import typer

from opsched.cli import app
from opsched.errors import OpschedError


def run_all_path() -> Path:
    """Where ``bench/run_all.py`` is: beside the ``opsched`` package in a checkout."""
    import opsched

    return Path(opsched.__file__).resolve().parent.parent / "bench" / "run_all.py"


def _load_run_all():  # -> module
    path = run_all_path()
    if not path.is_file():
        raise OpschedError(f"opsched bench needs a source checkout of opsched: {path} not found "
                           "(clone the repository and `pip install -e .`, then run `opsched bench` there)")
    spec = importlib.util.spec_from_file_location("opsched_bench_run_all", path)
    if spec is None or spec.loader is None:
        raise OpschedError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@app.command("bench")
def bench_cmd(
    quick: bool = typer.Option(False, "--quick", help="Smoke run (<= 5 min): fewer models, batch 1, few repeats."),
    out: str = typer.Option("runs", "--out", help="Folder that receives bench_<N>/."),
    sections: str = typer.Option("", "--sections", help="Subset of real,keras,sim,costs,fidelity (default all)."),
    models: str = typer.Option("", "--models", help="Zoo models for the real and fidelity sections."),
    batches: str = typer.Option("", "--batches", help="Batch sizes for the real section (default 1,8)."),
    rounds: int = typer.Option(0, "--rounds", help="Interleaved timing rounds (default 7; quick 3)."),
    policy: str = typer.Option("", "--policy", help="Exported learned policy folder ('none' to leave it out)."),
    search_trials: int = typer.Option(0, "--search-trials", help="Optuna search budget per graph."),
    no_compile: bool = typer.Option(False, "--no-compile", help="Leave torch.compile out."),
    profile: bool = typer.Option(False, "--profile", help="Profile zoo models that have no cached profile first."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Benchmark opsched against eager PyTorch, torch.compile, ONNX Runtime, TensorFlow and the lower bound."""
    argv: list[str] = ["--out", out]
    for flag, value in (("--sections", sections), ("--models", models), ("--batches", batches),
                        ("--policy", policy)):
        if value:
            argv += [flag, value]
    for flag, value in (("--rounds", rounds), ("--search-trials", search_trials)):
        if value:
            argv += [flag, str(value)]
    for flag, on in (("--quick", quick), ("--no-compile", no_compile), ("--profile", profile),
                     ("--no-progress", no_progress)):
        if on:
            argv.append(flag)
    typed = sys.argv[1:] if Path(sys.argv[0]).name == "opsched" and sys.argv[1:2] == ["bench"] else ["bench", *argv]
    module = _load_run_all()
    try:
        module.main(argv, command=shlex.join(["opsched", *typed]))
    except SystemExit as exc:  # the script's own usage errors: already printed, keep the status
        if exc.code not in (0, None):
            raise typer.Exit(exc.code if isinstance(exc.code, int) else 2) from None
