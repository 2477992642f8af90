"""The TensorFlow workers' wire format: a JSON header frame, then raw byte frames (no pickle).

A frame is an 8-byte little-endian length and that many bytes; a message is a
header (a UTF-8 JSON object) followed by ``header["nblobs"]`` frames.  Arrays
travel as ``.npy`` bytes (:func:`array_to_bytes`, read back without pickle).
Shared by the worker (:mod:`opsched.backends.tf_worker`, :mod:`opsched.backends.tf_step_worker`)
and its clients (:mod:`opsched.backends.tf_cpu`, :mod:`opsched.backends.tf_train`).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

_LEN = struct.Struct("<Q")
MAX_FRAME = 1 << 34  # 16 GiB: anything larger is a corrupt stream, not a model


class ChannelClosed(EOFError):
    """The other end closed the pipe (or died)."""


# ----------------------------------------------------------------- framing
def write_message(out: BinaryIO, header: dict[str, Any], blobs: Sequence[bytes] = ()) -> None:
    body = json.dumps({**header, "nblobs": len(blobs)}).encode()
    for frame in (body, *blobs):
        out.write(_LEN.pack(len(frame)))
        out.write(frame)
    out.flush()


def read_exact(inp: BinaryIO, n: int) -> bytes:
    chunks = []
    while n:
        chunk = inp.read(n)
        if not chunk:
            raise ChannelClosed("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_message(inp: BinaryIO) -> tuple[dict[str, Any], list[bytes]]:
    def frame() -> bytes:
        (n,) = _LEN.unpack(read_exact(inp, _LEN.size))
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes: corrupt stream")
        return read_exact(inp, n)

    header = json.loads(frame().decode())
    return header, [frame() for _ in range(int(header.get("nblobs", 0)))]


def array_to_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    a = np.asarray(a)
    np.save(buf, np.ascontiguousarray(a).reshape(a.shape), allow_pickle=False)  # 0-d stays 0-d
    return buf.getvalue()


def bytes_to_array(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)


# ------------------------------------------------------------------ worker
