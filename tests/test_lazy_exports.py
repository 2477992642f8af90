"""The lazily imported packages' ``__all__`` lists are literal (so type checkers read
them) and must stay equal to the names they resolve; every name resolves."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package, table", [("opsched.engine", "_EXPORTS"), ("opsched.importers", "_LAZY")])
def test_all_lists_the_lazy_names(package: str, table: str) -> None:
    mod = importlib.import_module(package)
    assert mod.__all__ == sorted(getattr(mod, table))


@pytest.mark.parametrize("package", ["opsched.engine"])
def test_every_lazy_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_top_level_lazy_names_resolve() -> None:
    import opsched

    assert callable(opsched.apply) and callable(opsched.train_step)
    assert opsched.ScheduledModule.__name__ == "ScheduledModule"
