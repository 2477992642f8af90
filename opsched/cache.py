"""Where opsched keeps what it measured and built: one per-user cache directory.

Profiles, fitted runtime models, ONNX exports and imported graphs used to
land in ``runs/`` under the *current* directory, so the same
``opsched.apply`` planned differently depending on where Python was started.
They now live in one cache per user, whatever the working directory:

=====================  =====================================================
``profiles/``          op profiles (``opsched profile``), keyed by graph and
                       machine fingerprints; ``profiles/ort/`` ONNX Runtime's
``profiles/runtime/``  fitted runtime models and the measured plans behind them
``onnx/``              ONNX exports of PyTorch models, keyed by the sources
``graphs/``            imported zoo / Keras graphs of training runs (JSON)
=====================  =====================================================

The directory is ``platformdirs.user_cache_path("opsched")`` (on Linux
``~/.cache/opsched``), or ``$OPSCHED_CACHE`` when set (the test suite sets
it to a temporary folder).  ``opsched cache --path`` prints it and ``opsched
cache --clear`` empties it.  Run outputs (``runs/<name>_<N>``, compare and
apply folders) are not caches: they stay where ``--out`` says.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: The environment variable that overrides the cache directory.
ENV = "OPSCHED_CACHE"
#: The sub-folders opsched writes (what ``opsched cache`` reports).
PARTS = ("profiles", "onnx", "graphs")


def root() -> Path:
    """The cache directory (``$OPSCHED_CACHE``, else the per-user cache of the platform)."""
    env = os.environ.get(ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_path("opsched"))


def profiles_dir(override: str | Path | None = None) -> Path:
    """Where op profiles live (``override`` when given: a caller's own profile folder)."""
    return Path(override) if override is not None else root() / "profiles"


def onnx_dir(override: str | Path | None = None) -> Path:
    """Where ONNX exports of PyTorch models are kept."""
    return Path(override) if override is not None else root() / "onnx"


def graphs_dir(override: str | Path | None = None) -> Path:
    """Where imported graphs of training runs are kept (JSON, simulation only)."""
    return Path(override) if override is not None else root() / "graphs"


def usage() -> dict[str, int]:
    """Bytes per part of the cache (0 for a part that does not exist)."""
    out = {}
    for part in PARTS:
        folder = root() / part
        out[part] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
    return out


def clear() -> int:
    """Delete everything opsched cached; return the bytes freed.  Only the known parts are
    removed, so pointing ``$OPSCHED_CACHE`` at a folder with other files never deletes those."""
    freed = sum(usage().values())
    for part in PARTS:
        folder = root() / part
        if folder.is_dir():
            shutil.rmtree(folder)
    return freed


__all__ = ["ENV", "PARTS", "clear", "graphs_dir", "onnx_dir", "profiles_dir", "root", "usage"]
