"""Small file helpers: writes that never leave a half-written file behind, and
JSON reads whose errors name the file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace``, so a
    crash or Ctrl-C leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a plain write would not
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def next_run_dir(root: str | Path, name: str) -> Path:
    """Create and return ``root/<name>_<N>`` with N the next free number.

    ``mkdir`` without ``exist_ok`` makes the choice race-free between processes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        candidate = root / f"{name}_{n}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1


def read_json(path: str | Path, error: type[Exception], what: str, fix: str = "", missing: str = "") -> Any:
    """The JSON in ``path``, or ``error`` with a message naming the file and what
    it should have held: ``"<path>: no such <what> file"`` (+ ``missing``, how to
    make one) or ``"<path>: not valid JSON, perhaps truncated (...)"`` (+ ``fix``)."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no such {what} file{missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{p}: cannot read the {what}: not valid JSON, perhaps truncated ({exc}){fix}") from None
