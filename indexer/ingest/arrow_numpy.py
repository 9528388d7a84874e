"""numpy views of Arrow arrays, read from their buffers.

pyarrow's own `to_numpy` (and numpy's `__array__` on an Arrow array) imports pandas whenever
pandas is installed (the `ray` extra brings it): about a second and 50 MB for every process
that reads Parquet, to convert a few primitive buffers. These helpers read the buffers as they
are: validity bitmaps, offsets and fixed-width values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Arrow's names of the fixed-width numeric types (str(pa.float32()) == "float", ...).
NUMERIC = {
    "halffloat": "<f2",
    "float": "<f4",
    "double": "<f8",
    "int8": "i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
}


def _bits(buf: Any, offset: int, length: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")
    return bits[offset : offset + length].astype(bool)


def valid(arr: Any) -> np.ndarray:
    """(len,) bool: the entries that are not null."""
    if str(arr.type) == "null":
        return np.zeros(len(arr), dtype=bool)
    buf = arr.buffers()[0]
    if arr.null_count == 0 or buf is None:
        return np.ones(len(arr), dtype=bool)
    return _bits(buf, arr.offset, len(arr))


def booleans(arr: Any) -> np.ndarray:
    """(len,) bool of a boolean array; nulls read as False."""
    return _bits(arr.buffers()[1], arr.offset, len(arr)) & valid(arr)


def is_numeric(arr_type: Any) -> bool:
    return str(arr_type) in NUMERIC


def numbers(arr: Any) -> np.ndarray:
    """(len,) values of a fixed-width numeric array, whatever sits under its nulls."""
    dtype = np.dtype(NUMERIC[str(arr.type)])
    return np.frombuffer(arr.buffers()[1], dtype)[arr.offset : arr.offset + len(arr)]


def strings(arr: Any) -> tuple[bytes, np.ndarray]:
    """(UTF-8 blob, (len + 1,) int64 offsets from 0) of a string or large_string array: entry
    i is blob[offsets[i]:offsets[i + 1]] (empty under a null)."""
    width = "<i8" if str(arr.type) == "large_string" else "<i4"
    off = np.frombuffer(arr.buffers()[1], width)[arr.offset : arr.offset + len(arr) + 1]
    off = off.astype(np.int64)
    data = arr.buffers()[2]  # a slice of a batch shares its parent's buffer: copy its span only
    blob = b"" if data is None else data[int(off[0]) : int(off[-1])].to_pybytes()
    return blob, off - off[0]
