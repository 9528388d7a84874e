"""Row-appendable `.npy` files whose length is unknown until the end: written in one streaming
pass (memory: one chunk), they get their final header when closed, so readers can memory-map
them.
"""

from __future__ import annotations

import ctypes
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import numpy as np

_NPY_HEADER_BYTES = 128  # magic + version + length + dict, padded; fixed so it can be patched
WRITEBACK_BYTES = 32 << 20  # written since the last nudge: the disk starts on them now
_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk, without waiting
    (Linux's sync_file_range). A build writes gigabytes that stay below the kernel's own
    writeback threshold: left alone, the disk sees none of them until the fsync, which then
    waits seconds with the cores idle. Durability is
    the publish's business (indexer.store.artifact.publish fsyncs the whole staged version before
    it moves it into place), so closing a file only starts its last writes too."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the head start


def _npy_header(rows: int, dim: int | None, descr: str = "<f4") -> bytes:
    shape = f"({rows},)" if dim is None else f"({rows}, {dim})"
    body = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    pad = _NPY_HEADER_BYTES - 10 - len(body) - 1
    if pad < 0:
        raise ValueError("shape too large for the fixed .npy header")
    return (
        b"\x93NUMPY\x01\x00"
        + struct.pack("<H", _NPY_HEADER_BYTES - 10)
        + (body + " " * pad + "\n").encode("latin1")
    )


class Appender(ABC):
    """Base: a file opened for writing, with a header patched on close. Rows are `dim` wide,
    or scalars when dim is None (a 1-D array).

    Close does not fsync: every appender writes into a staged version, which the publish
    fsyncs in full, after its check: an fsync per file at close would make the build wait for
    the disk where nothing else runs, while from the check on the disk catches up beside it."""

    dtype: np.dtype = np.dtype("<f4")

    def __init__(self, path: Path, dim: int | None, header_len: int):
        self.path = path
        self.dim = dim
        self.rows = 0
        self.header_len = header_len
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._written = self._nudged = 0  # bytes; bytes when writeback was last started
        self._write(b"\0" * header_len)

    def _write(self, data: Any) -> None:
        self._written += self._f.write(data)
        if self._written - self._nudged >= WRITEBACK_BYTES:
            self._f.flush()
            start_writeback(self._f.fileno())
            self._nudged = self._written

    def append(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, dtype=self.dtype)
        want = 1 if self.dim is None else 2
        if x.ndim != want or (self.dim is not None and x.shape[1] != self.dim):
            raise ValueError(f"{self.path.name}: expected rows of width {self.dim}, got {x.shape}")
        self._write(x.data if x.size else b"")
        self.rows += x.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop as appended so far (the file is flushed first)."""
        self._f.flush()
        width = 1 if self.dim is None else self.dim
        x = np.fromfile(
            self.path,
            dtype=self.dtype,
            count=(stop - start) * width,
            offset=self.header_len + start * width * self.dtype.itemsize,
        )
        return x if self.dim is None else x.reshape(-1, self.dim)

    @abstractmethod
    def _header(self) -> bytes:
        """The final header, written over the placeholder once the row count is known."""

    def _trailer(self) -> bytes:
        return b""

    def close(self) -> None:
        if self._f.closed:
            return
        self._write(self._trailer())
        self._f.seek(0)
        self._f.write(self._header())
        self._f.flush()
        start_writeback(self._f.fileno())
        self._f.close()

    def __enter__(self) -> Appender:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class NpyAppender(Appender):
    """A (rows, dim) `.npy` file (float32 unless told otherwise; (rows,) when dim is None),
    np.load(..., mmap_mode='r')-able once closed."""

    def __init__(self, path: Path, dim: int | None, dtype: str = "<f4"):
        self.dtype = np.dtype(dtype)
        super().__init__(path, dim, _NPY_HEADER_BYTES)

    def _header(self) -> bytes:
        return _npy_header(self.rows, self.dim, self.dtype.str)


class NpyRows:
    """Reads rows of a float32 or float16 .npy written by NpyAppender with plain reads, chunk
    by chunk, as float32 (a compact version's float16 embeddings are widened exactly).

    Build jobs use this instead of a memory map: pages of a map that has been read stay in the
    process's resident set, so a map over all rows would make peak memory grow with the
    record count. Index it with sorted row numbers; it reads the spans they cover.
    """

    def __init__(self, path: Path, raw: tuple[int, int, int] | None = None):
        """`raw`: (offset, N, d) of float16 rows in a file that is no .npy (a compact
        version's embeddings, indexer.store.fp16_file)."""
        self.path = path
        if raw is not None:
            self.offset, n, dim = raw
            self.shape: tuple[int, int] = (n, dim)
            self.dtype = np.dtype("<f2")
            return
        header = np.load(path, mmap_mode="r")  # parses the header; touches no data pages
        self.shape = (int(header.shape[0]), int(header.shape[1]))
        self.offset = int(header.offset)
        self.dtype = np.dtype(header.dtype)
        if self.dtype not in (np.dtype("<f4"), np.dtype("<f2")):
            raise ValueError(f"{path}: rows of {self.dtype}, expected float32 or float16")
        del header

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return np.zeros((0, self.shape[1]), dtype=np.float32)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        if hi - lo > 4 * idx.size + 1024:  # sparse rows: read two smaller spans, not one huge
            half = idx.size // 2
            return np.concatenate([self[idx[:half]], self[idx[half:]]])
        dim, size = self.shape[1], self.dtype.itemsize
        span = np.fromfile(
            self.path, dtype=self.dtype, count=(hi - lo) * dim, offset=self.offset + lo * dim * size
        ).reshape(hi - lo, dim)
        if size != 4:
            span = span.astype(np.float32)
        if hi - lo == idx.size and bool((np.diff(idx) == 1).all()):
            return span  # consecutive rows, the common case: no second copy
        return span[idx - lo]
