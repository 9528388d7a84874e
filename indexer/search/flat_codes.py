"""Batches of queries over flat codes: a compact version's float16 rows (`fp16` views) and
8-bit scalar codes (`sq8` views), both FAISS IndexScalarQuantizer files under inner product.

FAISS's own scan of such codes reads every code once per query. For a batch, the codes are
widened to float32 a block at a time (torch's copy: numpy's cast took five times as long) and
searched by BLAS products (indexer.search.exact), each code read once per batch. At 1M x 128 on
one thread, batches of 16: float16 rows 113-119 q/s against FAISS's 49, 8-bit codes 118
against 35, float32 flat search 120-135 (docs/benchmarks/compact.md).

8-bit codes decode as vmin + (code + 0.5) * vdiff / 255 per dimension (FAISS's QT_8bit), so
q . x = (q * vdiff / 255) . code + q . (vmin + vdiff / 510): the scaled query meets the raw
codes, and the rest is one number per query.
"""

from __future__ import annotations

import warnings
from typing import Any

import faiss
import numpy as np
import torch

from indexer.search import exact

WIDEN_BYTES = 8 << 20  # float32 bytes of one widened block


def codes_of(index: Any) -> np.ndarray:
    """The (N, code_size) codes of a faiss.IndexScalarQuantizer, as a read-only array over the
    index's own (possibly memory-mapped) bytes."""
    n, size = int(index.ntotal), int(index.code_size)
    if n == 0:
        return np.zeros((0, size), np.uint8)
    codes = faiss.rev_swig_ptr(index.codes.data(), n * size).reshape(n, size)
    codes.flags.writeable = False
    return codes


def batch_search(index: Any, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(scores, positions) of a batch over flat float16 or 8-bit codes, the scores FAISS's scan
    gives (the codes' inner products); None for any other index, which FAISS then searches."""
    if not isinstance(index, faiss.IndexScalarQuantizer):
        return None
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        return None
    qtype, dim = index.sq.qtype, int(index.d)
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    if qtype == faiss.ScalarQuantizer.QT_fp16:
        rows = codes_of(index).view(np.float16)
        return widened_search(xq, rows, k)
    if qtype == faiss.ScalarQuantizer.QT_8bit:
        trained = faiss.vector_to_array(index.sq.trained)
        vmin, vdiff = trained[:dim], trained[dim:]
        scaled = np.ascontiguousarray(xq * (vdiff / 255.0), dtype=np.float32)
        scores, pos = widened_search(scaled, codes_of(index), k)
        shift = xq @ (vmin + vdiff / 510.0)
        return np.where(pos >= 0, scores + shift[:, None], -np.inf).astype(np.float32), pos
    return None


def widened_search(xq: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product search of float32 queries over (N, d) rows of a narrower type,
    widened to float32 a block at a time; blocks merged in faiss.ResultHeap."""
    n, dim = rows.shape
    k = min(k, n)
    if k == 0 or len(xq) == 0:
        return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
    with warnings.catch_warnings():  # the rows are read-only: nothing here writes to them
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(rows)
    block = max(1, WIDEN_BYTES // (4 * max(1, dim)))
    buffer = torch.empty((min(block, n), dim), dtype=torch.float32)
    heap = faiss.ResultHeap(len(xq), k, keep_max=True)
    for start in range(0, n, block):
        widened = buffer[: min(block, n - start)]
        widened.copy_(source[start : start + block])
        scores, pos = exact.search(xq, widened.numpy(), k)
        heap.add_result(scores, np.where(pos >= 0, pos + start, -1))
    heap.finalize()
    return heap.D, heap.I
