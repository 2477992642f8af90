"""The ``opsched`` command line (typer + rich).

Each subcommand lives in its own module under ``opsched/commands/`` and
registers itself on :data:`app`; this file only creates the app and imports
them, so adding a command never touches another's code.
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


def main() -> None:
    """Entry point: run the app, turning opsched's own errors into one clear line (exit code 2)."""
    from rich.markup import escape

    from opsched.errors import OpschedError

    try:
        app(standalone_mode=False)
    except OpschedError as exc:
        console_for(stderr=True).print(f"[bold red]error:[/bold red] {escape(str(exc))}")
        sys.exit(2)
    except KeyboardInterrupt:
        console_for(stderr=True).print("[yellow]interrupted[/yellow]")
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:
        # Usage errors (bad option, missing argument) know how to show themselves;
        # matched by behaviour because typer may or may not bring click along.
        if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            sys.exit(exc.exit_code)
        raise


# Subcommands register themselves on import.
from opsched.commands import (  # noqa: E402,F401
    apply,
    bench,
    compare,
    export,
    graphs,
    machine,
    maestro,
    profile,
    quickstart,
    train,
    tune,
)

if __name__ == "__main__":
    # ``python -m opsched.cli``: the commands registered on the imported
    # ``opsched.cli`` module's app, not on this ``__main__`` copy's.
    from opsched.cli import main as _main

    _main()
