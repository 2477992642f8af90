"""The architecture holds: imports run down the layers only, and no module imports itself back.

Layers, lowest first (an import may go to the same or a lower layer; the package root
``opsched/__init__.py`` is the facade and exempt):

  core      opsched.<module> (graph, machine, plan, trace, cache, io, timing, synthetic, ...)
  engine    opsched.engine (contracts, simulator, models, bounds, profiles)
  front     opsched.importers, opsched.zoo, opsched.specs (networks in: may use the engine's graph tools)
  policies  opsched.policies
  backends  opsched.backends (runtimes and their profilers)
  planning  opsched.planning (the planning-model choice)
  envs      opsched.envs
  agents    opsched.agents
  library   opsched.scheduled / adapters / training / real_apply / measured / ceiling
  bench     opsched.benchmarks
  commands  opsched.commands, opsched.cli, opsched.__main__

Read with the package-dir mapping of pyproject.toml (envs/ is opsched.envs, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = {"opsched.envs": "envs", "opsched.agents": "agents", "opsched.backends": "backends",
       "opsched.policies": "policies"}
LAYER = {"engine": 1, "importers": 1.5, "zoo": 1.5, "specs": 1.5, "policies": 2, "backends": 3, "planning": 3.5, "envs": 4, "agents": 5,
         "scheduled": 6, "adapters": 6, "training": 6, "real_apply": 6, "measured": 6, "ceiling": 6,
         "benchmarks": 7, "commands": 8, "cli": 8, "__main__": 8}


def _modules() -> dict[str, Path]:
    out = {}
    for folder in ["opsched", *MAP.values()]:
        for p in (ROOT / folder).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            for pkg, d in MAP.items():
                if parts[0] == d:
                    parts = pkg.split(".") + parts[1:]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _layer(mod: str) -> float | None:
    parts = mod.split(".")
    return None if len(parts) == 1 else LAYER.get(parts[1], 0)


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {}
    for m, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("opsched"):
                for a in node.names:
                    cand = f"{node.module}.{a.name}"
                    deps.add(cand if cand in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("opsched"))
        edges[m] = {d for d in deps if d in mods and d != m}
    return edges


def test_no_import_runs_up_a_layer():
    mods = _modules()
    up = sorted((a, b) for a, bs in _edges(mods).items() for b in bs
                if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a))
    assert not up, f"imports running up: {up}"


def test_no_import_cycles():
    edges = _edges(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in list(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
