"""A compact version's float16 embeddings file (docs/design.md §5): a FAISS index file that
numpy can map too.

The file is FAISS's own serialisation of an IndexScalarQuantizer with QT_fp16 codes under inner
product: a fixed header, then the codes vector (its byte length, then the (N, d) float16 rows
in row order). So one copy of the embeddings is both

- the rows numpy reads (re-ranking, the embeddings endpoint, updates, verify): a (N, d)
  float16 memory map of the file's tail, widened exactly to float32 where needed, and
- an index FAISS searches as it is (read with IO_FLAG_MMAP_IFC: the codes stay memory-mapped,
  shared between workers): its SIMD fp16 scan ran a lone query over 200k x 128 about 20 times
  faster than widening memory-mapped float16 blocks with numpy to scan them as float32.

The file is written a chunk at a time (the header's row count and the codes' length patched
on close), so a build holds one chunk of it in memory.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from indexer.store.arrays import Appender

NTOTAL_AT = 8  # the header: fourcc (4 bytes), d (int32), ntotal (int64), ...
DTYPE = np.dtype("<f2")


class Fp16FileError(ValueError):
    """A file is not a float16 embeddings file of this layout."""


def _empty_header(dim: int) -> bytes:
    qt = faiss.ScalarQuantizer.QT_fp16
    index = faiss.IndexScalarQuantizer(dim, qt, faiss.METRIC_INNER_PRODUCT)
    return bytes(faiss.serialize_index(index))  # ends with the codes' length: 0


class Fp16Appender(Appender):
    """Rows appended as float16 (rounded to nearest) into a FAISS QT_fp16 index file."""

    def __init__(self, path: Path, dim: int):
        self.dtype = DTYPE
        self._empty = _empty_header(dim)
        super().__init__(path, dim, len(self._empty))

    def _header(self) -> bytes:
        assert self.dim is not None
        head = bytearray(self._empty)
        head[NTOTAL_AT : NTOTAL_AT + 8] = struct.pack("<q", self.rows)
        head[-8:] = struct.pack("<Q", self.rows * self.dim * DTYPE.itemsize)
        return bytes(head)


def layout(path: Path) -> tuple[int, int, int]:
    """(offset of the rows, N, d) of a float16 embeddings file; Fp16FileError if the file is
    not one (another index type, a length that does not add up)."""
    with open(path, "rb") as f:
        start = f.read(NTOTAL_AT + 8)
    if len(start) < NTOTAL_AT + 8 or start[:4] != b"IxSQ":
        raise Fp16FileError(f"{path}: not a FAISS scalar-quantiser index file")
    dim, n = struct.unpack("<i", start[4:8])[0], struct.unpack("<q", start[8:16])[0]
    header = len(_empty_header(dim)) if dim > 0 else 0
    size = path.stat().st_size
    if dim <= 0 or n < 0 or size != header + n * dim * DTYPE.itemsize:
        raise Fp16FileError(
            f"{path}: {size} bytes, not a float16 embeddings file of {n} rows of {dim}"
        )
    with open(path, "rb") as f:
        f.seek(header - 8)
        length = struct.unpack("<Q", f.read(8))[0]
    if length != n * dim * DTYPE.itemsize:
        raise Fp16FileError(f"{path}: codes of {length} bytes for {n} rows of {dim} float16")
    return header, n, dim


def map_rows(path: Path) -> np.ndarray:
    """The (N, d) float16 rows, memory-mapped read-only."""
    offset, n, dim = layout(path)
    if n == 0:
        return np.zeros((0, dim), DTYPE)
    return np.memmap(path, dtype=DTYPE, mode="r", offset=offset, shape=(n, dim))


def rows_of(index: Any) -> np.ndarray:  # a faiss.IndexScalarQuantizer
    """The (N, d) float16 rows of a float16 embeddings file read by read_index, as a read-only
    array over the index's own codes: no second mapping of the file (one would double the
    process's resident pages for the same bytes). It lives as long as the index does."""
    n, dim = int(index.ntotal), int(index.d)
    if n == 0:
        return np.zeros((0, dim), DTYPE)
    codes = faiss.rev_swig_ptr(index.codes.data(), n * dim * DTYPE.itemsize)
    rows = codes.view(DTYPE).reshape(n, dim)
    rows.flags.writeable = False
    return rows


def read_index(path: Path, mmap: bool = True) -> faiss.Index:
    """The file as a FAISS index, its codes memory-mapped (or read into memory)."""
    return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
