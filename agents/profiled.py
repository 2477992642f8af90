"""Training on the planning models of profiled machines (``profiled_machines`` in the training config).

``opsched profile --cluster ray`` leaves, for every distinct machine of a
cluster, its description (``<cache>/machines/<fingerprint>.yaml``), its op
profiles and its fitted runtime model in the profile cache.  A run whose
config names some of them (``--set profiled_machines=all`` or fingerprints)
trains on exactly those machines, each priced by its own planning model
(:func:`opsched.planning.planning_model`: the fitted profiles plus the
torch-cpu runtime model) instead of the analytic model of the presets.

One ScheduleEnv prices every machine with one model, so
:class:`ProfiledScheduleEnv` keeps one ScheduleEnv per machine and picks the
machine of each episode with its own generator (seeded by ``reset(seed=)``,
saved and restored with the checkpoints like any env's ``np_random``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from opsched.errors import ConfigError

MACHINES_DIR = "machines"


def cache_dir(profiles_dir: str | None = None) -> Path:
    """The profile cache (the planning model's default unless the config names one)."""
    from opsched.planning import default_cache_dir

    return Path(profiles_dir) if profiles_dir else Path(default_cache_dir())


def machine_file(fingerprint: str, cache: str | Path) -> Path:
    return Path(cache) / MACHINES_DIR / f"{fingerprint}.yaml"


def record_machine(machine: Any, cache: str | Path) -> Path:
    """Write ``machine``'s description where :func:`resolve_machines` finds it (by fingerprint)."""
    from opsched.io import atomic_write_text

    path = machine_file(machine.fingerprint(), cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, machine.to_yaml(comments=False))
    return path


def profiled_fingerprints(cache: str | Path) -> list[str]:
    folder = Path(cache) / MACHINES_DIR
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_machines(names: Sequence[str], cache: str | Path) -> list[str]:
    """``profiled_machines`` -> the machine files to train on (``all``: every recorded machine)."""
    known = profiled_fingerprints(cache)
    wanted = known if list(names) == ["all"] else list(names)
    if not wanted:
        raise ConfigError(f"profiled_machines: no profiled machine in {Path(cache) / MACHINES_DIR}; run "
                          "`opsched profile MODEL --cluster ray` first")
    missing = [n for n in wanted if n not in known]
    if missing:
        raise ConfigError(f"profiled_machines: {', '.join(missing)} not profiled (known in {cache}: "
                          f"{', '.join(known) or 'none'})")
    return [str(machine_file(fp, cache)) for fp in wanted]


def planning_models(machines: Sequence[Any], cache: str | Path) -> dict[str, Any]:
    """Fingerprint -> the planning model of each machine (its profiles must exist)."""
    from opsched.planning import planning_model

    return {m.fingerprint(): planning_model(m.cpu_only(), "torch-cpu", "fitted", cache) for m in machines}


def model_files(machines: Sequence[Any], cache: str | Path) -> dict[str, str]:
    """The cache files those planning models are made of (path inside the cache -> JSON text):
    what a worker on another node rebuilds them from (:func:`models_from_files`)."""
    from opsched.backends.runtime_fit import runtime_path
    from opsched.engine.profiles import Profile, ProfileError

    cache = Path(cache)
    out: dict[str, str] = {}
    for p in sorted(cache.glob("*.json")):
        try:
            prof = Profile.load(p)
        except ProfileError:
            continue
        if any(prof.matches_device(m.cpu) for m in machines):
            out[p.relative_to(cache).as_posix()] = p.read_text()
    for m in machines:
        rt = runtime_path(m.cpu_only(), "torch-cpu", cache)
        if rt.is_file():
            out[rt.relative_to(cache).as_posix()] = rt.read_text()
    return out


def models_from_files(files: Mapping[str, str], machines: Sequence[Any], where: str = "the driver") -> dict[str, Any]:
    """Rebuild :func:`planning_models` from :func:`model_files`' output (each path and JSON checked)."""
    from opsched.agents.wire import parse_cache_file, safe_relpath

    with tempfile.TemporaryDirectory(prefix="opsched-models-") as tmp:
        for rel, text in files.items():
            parse_cache_file(rel, text, where)
            path = Path(tmp) / safe_relpath(rel, where)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return planning_models(machines, tmp)


def make_profiled_env(graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int,
                      models: Mapping[str, Any], hint_plan: bool = True) -> ProfiledScheduleEnv:
    return ProfiledScheduleEnv(graphs, machines, max_nodes, models, hint_plan)


class ProfiledScheduleEnv(gym.Env):
    """ScheduleEnvs over ``graphs``, one per machine with that machine's planning model;
    each reset draws the machine (uniformly, from ``np_random``), then the
    machine's env draws the graph.  Steps, masks and the episode are that env's."""

    metadata = {"render_modes": []}

    def __init__(self, graphs: Sequence[Any], machines: Sequence[Any], max_nodes: int,
                 models: Mapping[str, Any], hint_plan: bool = True) -> None:
        from opsched.agents.environments import make_env

        super().__init__()
        self.machines = list(machines)
        self.envs = [make_env(graphs, [m], max_nodes, model=models[m.fingerprint()], hint_plan=hint_plan)
                     for m in self.machines]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self.current = self.envs[0]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        options = dict(options or {})
        machine = options.pop("machine", None)
        if machine is None:
            k = int(self.np_random.integers(len(self.envs)))
        else:
            fps = [m.fingerprint() for m in self.machines]
            k = fps.index(machine.fingerprint() if hasattr(machine, "fingerprint") else machine)
        self.current = self.envs[k]
        inner_seed = int(self.np_random.integers(np.iinfo(np.int64).max))
        return self.current.reset(seed=inner_seed, options=options or None)

    def step(self, action: int) -> tuple[dict, float, bool, bool, dict]:
        return self.current.step(action)

    def action_masks(self) -> np.ndarray:
        return self.current.action_masks()

    @property
    def episode(self) -> Any:
        return self.current.episode

    @property
    def episode_data(self) -> Any:
        return self.current.episode_data

    @property
    def layout(self) -> Any:
        return self.current.layout

    @property
    def model(self) -> Any:
        """The current machine's planning model (the teachers price its episode with it)."""
        return self.current.model

    def close(self) -> None:
        for env in self.envs:
            env.close()
