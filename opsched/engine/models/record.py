"""The file form of a fitted runtime model (``runs/profiles/runtime/<machine>/<backend>.json``).

Every runtime model (:class:`~opsched.engine.models.runtime.TorchCPURuntime`,
:class:`~opsched.engine.models.ort_runtime.OrtRuntime`) is a frozen dataclass of
float fields plus the graphs it was fitted on; this mixin reads and writes
that as JSON and checks every field, so a hand-edited or truncated file is an
error that names the file and the field, never a silently wrong model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from opsched.engine.profiles import ProfileError


class RuntimeRecord:
    """JSON round trip of a runtime model: ``backend``, the float ``_FIELDS``, ``fitted_on``."""

    backend: ClassVar[str]
    _FIELDS: ClassVar[tuple[str, ...]]
    _DEFAULTS: ClassVar[dict[str, float]] = {}
    #: Fields that may be negative (exponents); every other one must be >= 0.
    _SIGNED: ClassVar[frozenset[str]] = frozenset()
    #: The command that makes this file again.
    _REMAKE: ClassVar[str] = "opsched profile"

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, **{k: getattr(self, k) for k in self._FIELDS},
                "fitted_on": list(getattr(self, "fitted_on", ()))}

    @classmethod
    def check_fields(cls, vals: dict[str, float], where: str) -> None:
        """Further checks of a subclass (a range), raising :class:`ProfileError`."""

    @classmethod
    def from_dict(cls, data: Mapping[str, object], where: str = "<dict>") -> Any:
        backend = data.get("backend", cls.backend)
        if backend != cls.backend:
            raise ProfileError(f"{where}: a runtime model of backend {backend!r}, not {cls.backend!r}")
        try:
            vals = {k: float(data.get(k, cls._DEFAULTS.get(k, 0.0)))  # type: ignore[arg-type]
                    for k in cls._FIELDS}
            fitted_on = tuple(str(x) for x in data.get("fitted_on", ()))  # type: ignore[union-attr]
        except (TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: malformed runtime model: {exc}") from None
        bad = [k for k, v in vals.items() if not np.isfinite(v) or (v < 0 and k not in cls._SIGNED)]
        if bad:
            raise ProfileError(f"{where}: runtime model field {bad[0]} must be a finite number"
                               f"{'' if bad[0] in cls._SIGNED else ' >= 0'}, got {vals[bad[0]]!r}")
        cls.check_fields(vals, where)
        return cls(**vals, fitted_on=fitted_on)  # type: ignore[call-arg]

    def save(self, path: str | Path) -> None:
        from opsched.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Any:
        from opsched.io import read_json

        p = Path(path)
        data = read_json(p, ProfileError, "runtime model", fix=f"; delete it or run `{cls._REMAKE}` again")
        if not isinstance(data, Mapping):
            raise ProfileError(f"{p}: a runtime model is a JSON object")
        return cls.from_dict(data, where=str(p))


__all__ = ["RuntimeRecord"]
