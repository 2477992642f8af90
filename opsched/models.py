"""One place that turns a model *spec* string into a graph (or a torch module).

Every command that takes a model (``--model``) goes through :func:`load_graph`,
so the spec grammar is the same everywhere:

==================================  ==========================================
``zoo:NAME``                        a built-in zoo model (``opsched graphs``);
                                    a bare zoo name works too
``synthetic:FAMILY[:k=v...]``       a random DAG: ``synthetic:layered:n=100:seed=3``
                                    (``n`` ops, default 100; other options go to
                                    the family, e.g. ``p=0.1``)
``path/graph.json``                 a saved :class:`~opsched.graph.OpGraph`
``path/to/module.py:factory``       your own model: ``factory(batch)`` returns
                                    ``(nn.Module, example_inputs)``; it also gets
                                    ``width=`` / ``seed=`` if it accepts them
==================================  ==========================================

Torch specs (zoo and ``.py``) import through
:func:`opsched.importers.torch_fx.from_torch`, so their graphs carry an
executable ``TorchSource``; JSON and synthetic graphs have none (simulation only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from opsched.errors import GraphError, ModelImportError
from opsched.graph import OpGraph

SPEC_KINDS = "zoo:NAME, synthetic:FAMILY[:n=N][:seed=S], a .json graph file, or path/to/module.py:factory"


def _available() -> str:
    from opsched.synthetic import FAMILIES
    from opsched.zoo import ZOO

    return (f"expected {SPEC_KINDS}; zoo models: {', '.join(ZOO)}; "
            f"synthetic families: {', '.join(FAMILIES)}")


def _parse_options(parts: list[str], spec: str) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise GraphError(f"model spec {spec!r}: option {part!r} is not key=value")
        try:
            num = float(val)
        except ValueError:
            raise GraphError(f"model spec {spec!r}: option {key}={val!r} is not a number") from None
        opts[key] = int(num) if num.is_integer() and "." not in val else num
    return opts


def _split_py(spec: str) -> tuple[Path, str] | None:
    path, colon, factory = spec.rpartition(":")
    if colon and path.endswith(".py"):
        return Path(path), factory
    if spec.endswith(".py"):
        raise ModelImportError(
            f"model spec {spec!r}: name the factory function too, as path/to/module.py:factory"
        )
    return None


def _load_py_factory(path: Path, factory: str) -> Any:
    """Import the user's file by path (not by module name) and return its factory."""
    if not path.is_file():
        raise ModelImportError(f"model spec: no such file {str(path)!r}")
    if not factory.isidentifier():
        raise ModelImportError(f"model spec {path}:{factory}: {factory!r} is not a function name")
    modname = "opsched_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise ModelImportError(f"model spec: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # let the file import its siblings
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelImportError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    fn = getattr(module, factory, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == modname and not n.startswith("_"))
        raise ModelImportError(
            f"{str(path)!r} has no function {factory!r}; functions defined there: {', '.join(found) or 'none'}"
        )
    return fn


def _call_factory(fn: Any, where: str, batch: int, width: float, seed: int) -> tuple[Any, tuple]:
    import torch

    kwargs: dict[str, Any] = {}
    try:
        params = inspect.signature(fn).parameters
        for key, val in (("width", width), ("seed", seed)):
            if key in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kwargs[key] = val
    except (TypeError, ValueError):
        pass
    try:
        result = fn(batch, **kwargs)
    except Exception as exc:
        raise ModelImportError(f"{where}(batch={batch}) raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ModelImportError(
            f"{where}(batch) must return (nn.Module, example_inputs), got {type(result).__name__}"
        )
    module, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return module.eval(), tuple(inputs)


def load_model(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0) -> tuple[Any, tuple]:
    """The torch module (eval mode) and example inputs of a zoo or ``.py`` spec."""
    from opsched.zoo import ZOO, get_zoo_model

    spec = spec.strip()
    if spec.startswith("zoo:"):
        return get_zoo_model(spec[4:]).build(batch, width, seed)
    if spec in ZOO and not Path(spec).exists():
        return ZOO[spec].build(batch, width, seed)
    py = _split_py(spec)
    if py is not None:
        path, factory = py
        return _call_factory(_load_py_factory(path, factory), f"{path}:{factory}", batch, width, seed)
    raise ModelImportError(f"model spec {spec!r} is not a torch model; {_available()}")


def load_graph(spec: str, batch: int = 1, width: float = 1.0, seed: int = 0) -> OpGraph:
    """The OpGraph a spec names (see the module docstring for the grammar)."""
    from opsched.zoo import ZOO

    if not isinstance(spec, str) or not spec.strip():
        raise GraphError(f"empty model spec; {_available()}")
    spec = spec.strip()
    if spec.startswith("synthetic:"):
        from opsched.synthetic import generate

        family, *parts = spec[len("synthetic:"):].split(":")
        opts = _parse_options(parts, spec)
        n_ops = int(opts.pop("n", 100))
        s = int(opts.pop("seed", seed))
        return generate(family, n_ops, s, **opts)
    if spec.endswith(".json"):
        return OpGraph.load(spec)
    if spec.startswith("zoo:") or (spec in ZOO and not Path(spec).exists()) or _split_py(spec) is not None:
        from opsched.importers.torch_fx import from_torch

        module, inputs = load_model(spec, batch, width, seed)
        name = spec[4:] if spec.startswith("zoo:") else (spec if spec in ZOO else spec.rpartition(":")[2])
        return from_torch(module, inputs, name=name)
    raise GraphError(f"unknown model spec {spec!r}; {_available()}")


__all__ = ["load_graph", "load_model", "SPEC_KINDS"]
