"""Row-appendable files whose length is unknown until the end: `.npy` matrices and flat FAISS
indexes. Both are written in one streaming pass (memory: one chunk) and get their final header
when closed, so readers can memory-map them.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

import numpy as np

_NPY_HEADER_BYTES = 128  # magic + version + length + dict, padded; fixed so it can be patched


def _npy_header(rows: int, dim: int) -> bytes:
    body = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}"
    pad = _NPY_HEADER_BYTES - 10 - len(body) - 1
    if pad < 0:
        raise ValueError("shape too large for the fixed .npy header")
    return (
        b"\x93NUMPY\x01\x00"
        + struct.pack("<H", _NPY_HEADER_BYTES - 10)
        + (body + " " * pad + "\n").encode("latin1")
    )


class _Appender(ABC):
    """Base: a file opened for writing, with a header patched on close and fsync on close."""

    def __init__(self, path: Path, dim: int, header_len: int):
        self.path = path
        self.dim = dim
        self.rows = 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(b"\0" * header_len)

    def append(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, dtype="<f4")
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{self.path.name}: expected rows of width {self.dim}, got {x.shape}")
        self._f.write(x.tobytes())
        self.rows += x.shape[0]

    @abstractmethod
    def _header(self) -> bytes:
        """The final header, written over the placeholder once the row count is known."""

    def _trailer(self) -> bytes:
        return b""

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.write(self._trailer())
        self._f.seek(0)
        self._f.write(self._header())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> _Appender:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class NpyAppender(_Appender):
    """A float32 (rows, dim) `.npy` file, np.load(..., mmap_mode='r')-able once closed."""

    def __init__(self, path: Path, dim: int):
        super().__init__(path, dim, _NPY_HEADER_BYTES)

    def _header(self) -> bytes:
        return _npy_header(self.rows, self.dim)


_METRIC_INNER_PRODUCT = 0
_FLAT_HEADER = struct.Struct("<4siqqqBiq")  # fourcc, d, ntotal, 2 dummies, trained, metric, size


class FlatIPAppender(_Appender):
    """An IndexFlatIP file byte-identical to faiss.write_index's, written without holding the
    vectors in memory; faiss.read_index(path, faiss.IO_FLAG_MMAP) maps it read-only."""

    def __init__(self, path: Path, dim: int):
        super().__init__(path, dim, _FLAT_HEADER.size)

    def _header(self) -> bytes:
        return _FLAT_HEADER.pack(
            b"IxFI",
            self.dim,
            self.rows,
            1 << 20,
            1 << 20,
            1,
            _METRIC_INNER_PRODUCT,
            self.rows * self.dim,
        )
