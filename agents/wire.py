"""What opsched sends between cluster nodes, and how: JSON text and raw array bytes, never pickles.

Ray moves task arguments and results between the members of a cluster with
its own serializer (pickle); the members are trusted processes of one
cluster, started by the user.  opsched's own payloads do not rely on it: what
an opsched process hands another one is plain data in the formats it keeps on
disk, so a peer's bytes are parsed, checked and only then used:

* **graphs**: ``OpGraph.to_dict()`` (the graph JSON of ``opsched graphs``), or
  a spec string (``zoo:resnet50@1x0.5``) where a node must import the model
  to execute it; either comes with its fingerprint, checked on arrival;
* **machines**: ``Machine.to_dict()`` (the machine YAML's fields) and fingerprint;
* **plans**: ``Plan.to_dict()`` (an episode's final plan, in its info);
* **profiles and runtime models**: the profile cache's JSON files, as text,
  with their path inside the cache (:func:`safe_relpath`);
* **observations, rewards, masks**: :func:`pack_arrays` - a JSON header
  (name, dtype, shape) followed by the arrays' raw bytes; :func:`unpack_arrays`
  accepts only plain numeric dtypes (no object arrays), checks every size, and
  copies out of the buffer.  ``np.savez`` would do the same job at ten times
  the cost (480 us per observation against a 50 us simulator step).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from opsched.errors import OpschedError

#: First bytes of a packed array message (format version 1).
MAGIC = b"OPSW1\0"
#: The dtypes an array message may carry: plain numbers and booleans, little-endian.
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<f2", "<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "<u2", "|u1", "|b1"})
#: File suffixes of the profile cache that may cross nodes (text formats only).
CACHE_SUFFIXES = (".json",)


class WireError(OpschedError):
    """A message from another node that is not what opsched sends (the message says what and where)."""


def pack_arrays(arrays: Mapping[str, np.ndarray], meta: Any = None) -> bytes:
    """``arrays`` (name -> numeric array) and JSON-able ``meta`` as one bytes message."""
    entries, bodies = [], []
    for name, a in arrays.items():
        a = np.asarray(a)
        if not a.flags.c_contiguous:  # (not ascontiguousarray: it turns a 0-d array into a 1-d one)
            a = a.copy(order="C")
        if a.dtype.str not in ALLOWED_DTYPES:
            raise WireError(f"pack_arrays: {name!r} has dtype {a.dtype} (only plain numbers and booleans cross nodes)")
        entries.append([str(name), a.dtype.str, list(a.shape)])
        bodies.append(a.tobytes())
    header = json.dumps({"meta": meta, "arrays": entries}, separators=(",", ":")).encode()
    return b"".join([MAGIC, len(header).to_bytes(4, "little"), header, *bodies])


def unpack_arrays(blob: bytes, where: str = "a peer") -> tuple[dict[str, np.ndarray], Any]:
    """Undo :func:`pack_arrays`: (name -> array, meta); a malformed message raises WireError naming ``where``."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + 4 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise WireError(f"message from {where}: not an opsched array message (bad magic)")
    n = int.from_bytes(view[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + n
    try:
        header = json.loads(bytes(view[len(MAGIC) + 4:start]))
        entries, meta = header["arrays"], header.get("meta")
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"message from {where}: unreadable header ({exc})") from None
    out: dict[str, np.ndarray] = {}
    pos = start
    for entry in entries:
        try:
            name, dtype, shape = str(entry[0]), str(entry[1]), tuple(int(d) for d in entry[2])
        except (TypeError, ValueError, IndexError):
            raise WireError(f"message from {where}: malformed array entry {entry!r}") from None
        if dtype not in ALLOWED_DTYPES or any(d < 0 for d in shape):
            raise WireError(f"message from {where}: array {name!r} has dtype {dtype!r} / shape {shape}; "
                            "only plain numeric arrays are accepted")
        size = int(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)))
        if pos + size > len(view):
            raise WireError(f"message from {where}: array {name!r} runs past the end of the message")
        out[name] = np.frombuffer(view[pos:pos + size], dtype=dtype).reshape(shape).copy()
        pos += size
    if pos != len(view):
        raise WireError(f"message from {where}: {len(view) - pos} bytes left over after the arrays")
    return out, meta


# --------------------------------------------------------------------- infos
def info_to_wire(info: Mapping[str, Any]) -> dict[str, Any]:
    """An env step's info as JSON-able data: numbers, strings and lists as they
    are, a ``Plan`` as ``{"plan": Plan.to_dict()}``; a Trace (and anything else
    without a plain form) is left behind on the worker."""
    from opsched.plan import Plan

    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, Plan):
            out[key] = {"__plan__": value.to_dict()}
        else:
            plain = _plain(value)
            if plain is not _DROP:
                out[key] = plain
    return out


def info_from_wire(data: Mapping[str, Any], where: str = "a peer") -> dict[str, Any]:
    """Undo :func:`info_to_wire` (plans are parsed and checked by ``Plan.from_dict``)."""
    from opsched.plan import Plan

    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and set(value) == {"__plan__"}:
            value = Plan.from_dict(value["__plan__"], where=f"{where}: info[{key!r}]")
        out[key] = value
    return out


_DROP = object()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else items
    if isinstance(value, Mapping):
        items = {str(k): _plain(v) for k, v in value.items()}
        return _DROP if any(v is _DROP for v in items.values()) else items
    return _DROP


# ------------------------------------------------------------- cache files
def safe_relpath(path: str, where: str = "a peer") -> PurePosixPath:
    """A path inside the profile cache as another node named it: relative, no
    ``..``, a text suffix (:data:`CACHE_SUFFIXES`); anything else is refused."""
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or any(part in ("..", ".", "") for part in p.parts) or "\\" in path:
        raise WireError(f"file from {where}: {path!r} is not a plain path inside the cache")
    if p.suffix not in CACHE_SUFFIXES:
        raise WireError(f"file from {where}: {path!r} is not one of the cache's text formats {CACHE_SUFFIXES}")
    return p


def parse_cache_file(path: str, text: str, where: str = "a peer") -> Any:
    """The JSON of a cache file another node sent (WireError if it is not JSON)."""
    safe_relpath(path, where)
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise WireError(f"file {path} from {where}: not valid JSON ({exc})") from None
