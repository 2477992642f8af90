"""Measured op profiles: the file format every profiler writes and the fitted models read.

A :class:`Profile` holds the measured per-op times of one graph on one
machine's CPU (``opsched profile``; :mod:`opsched.backends.profiler` for
PyTorch's kernels, :mod:`opsched.backends.ort_profiler` for ONNX Runtime's),
plus the co-run interference fit.  It is plain JSON (never pickle), cached as
``<cache>/profiles/<graph fingerprint>_<machine fingerprint>.json`` in the
per-user cache (:mod:`opsched.cache`) with an atomic write.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from opsched.cache import profiles_dir
from opsched.engine.models.interference import PairRecord
from opsched.errors import OpschedError
from opsched.graph import Op, OpGraph
from opsched.io import atomic_write_text
from opsched.machine import Device, Machine

PROFILE_FORMAT = "opsched.profile"


PROFILE_FORMAT_VERSION = 1




class ProfileError(OpschedError, ValueError):
    """A profile that cannot be made or read (the message says which file or op)."""


# ------------------------------------------------------------------ records
def op_signature(op: Op) -> tuple:
    """How ops of different graphs are matched: same kind, output shape, FLOPs and bytes."""
    return (op.kind, tuple(op.shape), round(float(op.flops)), round(float(op.bytes_total)))


@dataclass(frozen=True)
class OpProfile:
    """One op's measured times: ``samples[k]`` are seconds per call at ``k`` threads."""

    id: str
    kind: str
    flops: float
    bytes_total: float
    shape: tuple[int, ...]
    samples: Mapping[int, tuple[float, ...]]
    others_cores: float = 0.0  # cores other processes used while it was measured
    dropped_rounds: Mapping[int, int] = field(default_factory=dict)  # per level, rounds dropped as preempted

    @cached_property
    def median(self) -> dict[int, float]:
        return {k: float(np.median(v)) for k, v in self.samples.items() if v}

    @cached_property
    def quartiles(self) -> dict[int, tuple[float, float]]:
        return {k: (float(np.percentile(v, 25)), float(np.percentile(v, 75))) for k, v in self.samples.items() if v}

    @property
    def signature(self) -> tuple:
        return (self.kind, tuple(self.shape), round(self.flops), round(self.bytes_total))

    def suspect_levels(self, contention_limit: float = 0.25) -> set[int]:
        """Multi-thread levels not to trust: measured while other processes used
        more than ``contention_limit`` cores *and* more than twice as slow as the
        lowest level - the signature of a helper thread waiting for a core."""
        if self.others_cores <= contention_limit or not self.median:
            return set()
        lo = min(self.median)
        return {k for k, t in self.median.items() if k != lo and t > 2.0 * self.median[lo]}

    def speedup(self, k: int) -> float:
        """Time at the lowest level over time at ``k`` threads."""
        return self.median[min(self.median)] / self.median[k]


@dataclass(frozen=True)
class Profile:
    """Measured per-op times of one graph on one machine, plus the co-run fit."""

    graph_fingerprint: str
    graph_name: str
    machine_fingerprint: str
    machine_name: str
    device: Mapping[str, Any]  # the profiled CPU Device as a dict
    levels: tuple[int, ...]
    ops: Mapping[str, OpProfile]
    interference: Mapping[str, Any] | None = None  # {"fit": {...}, "pairs": [...], "bandwidth_gbs": {...}}
    settings: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------- queries
    def time(self, op_id: str, threads: int) -> float:
        """Median seconds of ``op_id`` at ``threads`` (ProfileError if not measured)."""
        try:
            return self.ops[op_id].median[threads]
        except KeyError:
            raise ProfileError(
                f"profile of {self.graph_name!r} has no time for op {op_id!r} at {threads} threads "
                f"(levels {list(self.levels)})"
            ) from None

    @property
    def cpu(self) -> Device:
        return Device(**self.device)

    def matches_device(self, device: Device) -> bool:
        """True when ``device`` is the device this profile measured (same hardware description)."""
        mine = self.device
        return (device.kind == mine.get("kind") and device.cores == mine.get("cores")
                and device.name == mine.get("name") and device.sockets == mine.get("sockets")
                and device.smt == mine.get("smt"))

    def total_time(self, threads: int) -> float:
        return float(sum(p.median.get(threads, 0.0) for p in self.ops.values()))

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_FORMAT_VERSION,
            "graph": {"fingerprint": self.graph_fingerprint, "name": self.graph_name},
            "machine": {"fingerprint": self.machine_fingerprint, "name": self.machine_name,
                        "device": dict(self.device)},
            "levels": list(self.levels),
            "settings": dict(self.settings),
            "ops": [
                {"id": p.id, "kind": p.kind, "flops": p.flops, "bytes": p.bytes_total, "shape": list(p.shape),
                 # integer nanoseconds: exact, compact
                 "samples_ns": {str(k): [max(1, int(round(t * 1e9))) for t in v] for k, v in p.samples.items()},
                 "others_cores": round(p.others_cores, 3),
                 "dropped_rounds": {str(k): v for k, v in p.dropped_rounds.items()}}
                for p in self.ops.values()
            ],
            "interference": self.interference,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "<dict>") -> Profile:
        if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: not an opsched profile (missing format {PROFILE_FORMAT!r})")
        if data.get("version") != PROFILE_FORMAT_VERSION:
            raise ProfileError(f"{where}: profile format version {data.get('version')!r} is not supported "
                               f"(this opsched reads version {PROFILE_FORMAT_VERSION}); re-profile with --refresh")
        try:
            ops = {}
            for o in data["ops"]:
                samples = {int(k): tuple(float(t) * 1e-9 for t in v) for k, v in o["samples_ns"].items()}
                if any(not v or min(v) <= 0 for v in samples.values()):
                    raise ValueError(f"op {o['id']!r} has an empty or non-positive sample list")
                ops[str(o["id"])] = OpProfile(str(o["id"]), str(o["kind"]), float(o["flops"]), float(o["bytes"]),
                                              tuple(int(d) for d in o["shape"]), samples,
                                              float(o.get("others_cores", 0.0)),
                                              {int(k): int(v) for k, v in o.get("dropped_rounds", {}).items()})
            inter = data.get("interference")
            if inter is not None:
                if not isinstance(inter, Mapping):
                    raise ValueError("interference is not a mapping")
                for r in inter.get("pairs", []):
                    PairRecord(**r)  # the fields a fitted model will read
                for v in inter.get("bandwidth_gbs", {}).values():
                    float(v)
            g, m = data["graph"], data["machine"]
            return cls(str(g["fingerprint"]), str(g["name"]), str(m["fingerprint"]), str(m["name"]),
                       dict(m["device"]), tuple(int(k) for k in data["levels"]), ops,
                       data.get("interference"), dict(data.get("settings", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: malformed profile: {type(exc).__name__}: {exc}") from None

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ProfileError(f"{p}: no such profile file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{p}: cannot read profile ({exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                               "the file is truncated or corrupt - delete it or re-profile with --refresh") from None
        return cls.from_dict(data, where=str(p))


def cache_path(graph: OpGraph, machine: Machine, cache_dir: str | Path | None = None) -> Path:
    """Where the profile of ``graph`` on ``machine`` is cached (default: the per-user cache's ``profiles/``)."""
    return profiles_dir(cache_dir) / f"{graph.fingerprint()}_{machine.hardware_fingerprint()}.json"


def load_profiles(machine: Machine | None = None, cache_dir: str | Path | None = None) -> list[Profile]:
    """Every readable cached profile (of ``machine`` when given); unreadable ones are skipped with a warning."""
    out = []
    suffix = f"_{machine.hardware_fingerprint()}.json" if machine is not None else ".json"
    for p in sorted(profiles_dir(cache_dir).glob(f"*{suffix}")):
        try:
            out.append(Profile.load(p))
        except ProfileError as exc:
            warnings.warn(f"skipping unreadable profile: {exc}", stacklevel=2)
    return out
