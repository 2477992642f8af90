"""The ``opsched`` command line (typer + rich).

Each subcommand lives in its own module under ``opsched/commands/`` and
registers itself on :data:`app`; this file only creates the app and imports
them, so adding a command never touches another's code.
"""

from __future__ import annotations

import typer

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


def main() -> None:
    """Entry point: run the app, turning opsched's own errors into one clear line."""
    import sys

    from rich.console import Console

    from opsched.errors import OpschedError

    try:
        app(standalone_mode=False)
    except OpschedError as exc:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {exc}")
        sys.exit(2)
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted[/yellow]")
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
