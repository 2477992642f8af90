"""The one progress bar of opsched's long work (training, profiling, timing, benchmarks).

Every long loop shows the same columns - what it does, a bar, done/total,
elapsed time and, where the total is known up front, the time left - so a user
reads them the same way everywhere.  Disabled bars print nothing (``--no-progress``,
or output that is not a terminal: :func:`opsched.cli.want_progress`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def progress_bar(*, console: Any = None, enabled: bool = True, transient: bool = False, eta: bool = True,
                 fields: Sequence[str] = ()) -> Any:
    """A ``rich.progress.Progress`` with opsched's columns; ``fields`` are task
    fields shown after them (``bar.add_task(..., note="")``)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns: list[Any] = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn()]
    if eta:
        columns.append(TimeRemainingColumn())
    columns += [TextColumn(f"{{task.fields[{f}]}}") for f in fields]
    return Progress(*columns, console=console, disable=not enabled, transient=transient)


__all__ = ["progress_bar"]
