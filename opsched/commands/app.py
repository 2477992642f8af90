"""The ``opsched`` typer app and what every command shares (console, ``--progress``).

Commands (one module each in this package) register on :data:`app`;
:mod:`opsched.cli` imports them and runs the app, so no command imports the
CLI module back.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console

app = typer.Typer(
    name="opsched",
    help="Learn and apply fast schedules (threads, co-running, order, placement) for neural-network graphs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root() -> None:
    """Learn and apply fast schedules for neural-network graphs."""


def console_for(stderr: bool = False) -> Console:
    """The console every command prints with: no emoji codes (``:factory`` is a
    name, not a picture), and in a log file (not a terminal) wide enough that
    no table is cut to 80 columns."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 250
    return Console(stderr=stderr, emoji=False, width=width, highlight=False)


def progress_option(default: bool | None = None) -> Any:
    """``--progress/--no-progress``, the same on every command: live progress bars
    with counts and time left (default: on when stderr is a terminal)."""
    return typer.Option(default, "--progress/--no-progress",
                        help="Show progress bars (default: when stderr is a terminal).", show_default=False)


def want_progress(flag: bool | None) -> bool:
    """The ``--progress`` flag's value, ``None`` meaning: is stderr a terminal?"""
    return sys.stderr.isatty() if flag is None else bool(flag)


__all__ = ["app", "console_for", "progress_option", "want_progress"]
