"""Shared fixtures, the gpu / tf markers' skip logic, and the suite's hygiene.

Hygiene: the suite never writes into the checkout.  Every test runs in its own
temporary working directory (so a default ``--out runs`` lands there) and the
whole session uses a temporary opsched cache (``$OPSCHED_CACHE``, so profiles,
exports and fitted runtime models of one test run never leak into another or
into the user's cache); at the end the checkout's files are compared with
those before the run and any new one fails the session.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from opsched.graph import Edge, Op, OpGraph


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_tf = pytest.mark.skip(reason="needs tensorflow (pip install -e '.[tf]')")
    has_cuda = _has_cuda()
    has_tf = importlib.util.find_spec("tensorflow") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "tf" in item.keywords and not has_tf:
            item.add_marker(skip_tf)


@pytest.fixture
def diamond() -> OpGraph:
    """a -> (b, c) -> d: the smallest graph with two parallel branches."""
    ops = [
        Op("a", "a", "conv", 2e6, 1e4, 1e4, 1e3, (1, 8, 8, 8)),
        Op("b", "b", "matmul", 4e6, 2e4, 1e4, 2e3, (1, 64)),
        Op("c", "c", "elementwise", 1e4, 1e4, 1e4, 0, (1, 64)),
        Op("d", "d", "concat_split", 0, 2e4, 2e4, 0, (1, 128)),
    ]
    edges = [Edge("a", "b", 1e4), Edge("a", "c", 1e4), Edge("b", "d", 1e4), Edge("c", "d", 1e4)]
    return OpGraph(tuple(ops), tuple(edges), name="diamond")


REPO = Path(__file__).resolve().parent.parent
_SKIP_PARTS = {".venv", ".git", "__pycache__", ".ruff_cache", ".hypothesis", ".pytest_cache"}


def _checkout_files() -> set[str] | None:
    """Every file of the checkout git does not track (untracked and ignored), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--ignored", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    files = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    return {f for f in files if not (set(Path(f).parts) & _SKIP_PARTS) and not f.endswith(".egg-info/")
            and ".egg-info" not in f}


def pytest_sessionstart(session):
    session.config._opsched_files_before = _checkout_files()
    if not os.environ.get("OPSCHED_CACHE"):
        import tempfile

        session.config._opsched_cache = tempfile.TemporaryDirectory(prefix="opsched-test-cache-")
        os.environ["OPSCHED_CACHE"] = session.config._opsched_cache.name


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_opsched_files_before", None)
    after = _checkout_files()
    if before is not None and after is not None:
        new = sorted(after - before)
        if new:
            print(f"\nthe test run wrote into the checkout {REPO}: {', '.join(new[:10])}"
                  + (f" (and {len(new) - 10} more)" if len(new) > 10 else ""))
            session.exitstatus = 1
    cache = getattr(session.config, "_opsched_cache", None)
    if cache is not None:
        cache.cleanup()


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Each test runs in its own temporary working directory."""
    monkeypatch.chdir(tmp_path)
