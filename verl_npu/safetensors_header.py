"""A safetensors file's header, checked before a byte of it is trusted (no torch: preflight reads it too).

The format: an 8-byte little-endian header length, a JSON object of tensor entries (``dtype``, ``shape``,
``data_offsets`` into the data section that follows) and an optional ``__metadata__``. Every entry is checked: a
known dtype, a shape of non-negative integers, offsets inside the file's data section that span exactly what the
shape and the dtype's size need. A bad file is refused naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1,
}  # fmt: skip


class CheckpointFileError(ValueError):
    """A safetensors file that cannot be what it claims."""


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """(name -> {"dtype": the safetensors dtype name, "shape", "offsets"} checked against the file's size, the data
    section's start)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointFileError(f"{path}: {size} bytes, shorter than a safetensors header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointFileError(f"{path}: header of {length} bytes in a file of {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CheckpointFileError(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: the header is not a JSON object")
    start, data = 8 + length, size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _checked_entry(path, name, entry, data)
    return tensors, start


def _checked_entry(path: Path, name: str, entry: object, data: int) -> dict:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointFileError(f"{path}: tensor {name!r} has no dtype, shape and data_offsets")
    itemsize = DTYPE_SIZES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if itemsize is None:
        raise CheckpointFileError(
            f"{path}: tensor {name!r} has dtype {entry['dtype']!r}; known: {', '.join(DTYPE_SIZES)}"
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointFileError(f"{path}: tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointFileError(f"{path}: tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * itemsize
    if not 0 <= begin <= end <= data or end - begin != expected:
        raise CheckpointFileError(
            f"{path}: tensor {name!r} ({entry['dtype']} {shape}) spans bytes [{begin}, {end}) of a {data}-byte data "
            f"section; its shape needs {expected} bytes"
        )
    return {"dtype": entry["dtype"], "shape": shape, "offsets": (begin, end)}
