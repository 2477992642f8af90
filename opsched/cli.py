"""The ``opsched`` command line (typer + rich).

Each subcommand lives in its own module under ``opsched/commands/`` and
registers itself on the app (:mod:`opsched.commands.app`); this file imports
them and runs the app, so adding a command never touches another's code.
"""

from __future__ import annotations

import sys

# Subcommands register themselves on import.
from opsched.commands import (  # noqa: F401
    apply,
    bench,
    cache,
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
from opsched.commands.app import app, console_for, progress_option, want_progress


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
        show, code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            sys.exit(code)
        raise


__all__ = ["app", "console_for", "main", "progress_option", "want_progress"]

if __name__ == "__main__":
    main()
