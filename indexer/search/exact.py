"""Exact maximum-inner-product search over a memory-mapped (N, D) float32 matrix, through FAISS's
own entry points: `faiss.knn` (its scan with a top-k heap per query for a few queries, its BLAS
products from BLAS_FROM queries on, blocked so no temporary the size of the view is made), and
for a filter the allowed rows gathered block by block and merged in `faiss.ResultHeap`. Threads
are FAISS's (faiss.omp_set_num_threads and its BLAS's; HCLIP_FAISS_THREADS in the service).

Both return (scores, positions), (nq, k), best first. Under ties they may pick different
positions of equal score; every returned score is the exact inner product of its position
(within float rounding).
"""

from __future__ import annotations

import warnings

import faiss
import numpy as np
import torch

GATHER_BYTES = 16 << 20  # allowed rows copied out per block under a filter
# Exact search runs FAISS's BLAS products from this many queries, its per-query scan below:
# from 8 the products win or tie (docs/benchmarks/serving.md: 1M x 256 on one thread, 37
# against 28 q/s at 8 queries, 94 against 28 at 32). FAISS's own switch compares queries x d
# with 128,000, so a server's batches over d <= 4,000 never reached its products.
BLAS_FROM = 8
_blas_from = BLAS_FROM


def use_blas_from(queries: int) -> None:
    """Exact searches of this many queries or more run FAISS's BLAS products (process-wide)."""
    global _blas_from
    _blas_from = queries


def blas_from() -> int:
    """The batch from which exact searches run BLAS products (use_blas_from)."""
    return _blas_from


def _empty(nq: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((nq, 0), np.float32), np.zeros((nq, 0), np.int64)


def search(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, min(k, N)); empty when N or k is 0."""
    k = min(k, xb.shape[0])
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    # FAISS's switch is one process-wide value and depends on d: set for this call (a search
    # on another thread at the same moment could take the other kernel, never a wrong answer)
    faiss.cvar.distance_compute_blas_threshold = _blas_from * xb.shape[1]
    threads = faiss.omp_get_max_threads()  # this thread's OpenMP setting
    if len(xq) >= threads or len(xq) >= _blas_from:
        scores, pos = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
        return scores, pos
    # FAISS's scan spreads queries over its threads; fewer queries than threads run several
    # times slower than one thread each (1M x 256, one query: 8 q/s on two threads, 25 on one)
    faiss.omp_set_num_threads(len(xq))
    try:
        scores, pos = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
    finally:
        faiss.omp_set_num_threads(threads)
    return scores, pos


# float16 rows widened to float32 a block at a time: this many bytes of float32 a block
WIDEN_BYTES = 8 << 20


def search_float16(xq: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact search of a batch over (N, d) float16 rows (a compact version's embeddings): a
    block of rows at a time is widened to float32 (torch's copy, SIMD: numpy's cast took five
    times as long) and searched by `search` (BLAS products), the blocks merged in
    faiss.ResultHeap. FAISS's own float16 scan reads every row once per query; this reads each
    once per batch (1M x 128 on one thread, 16 queries: 113-119 q/s against 49,
    docs/benchmarks/compact.md)."""
    n, dim = rows.shape
    k = min(k, n)
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    with warnings.catch_warnings():  # the rows are read-only: nothing here writes to them
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(rows)
    block = max(1, WIDEN_BYTES // (4 * max(1, dim)))
    buffer = torch.empty((min(block, n), dim), dtype=torch.float32)
    heap = faiss.ResultHeap(len(xq), k, keep_max=True)
    for start in range(0, n, block):
        widened = buffer[: min(block, n - start)]
        widened.copy_(source[start : start + block])
        scores, pos = search(xq, widened.numpy(), k)
        heap.add_result(scores, np.where(pos >= 0, pos + start, -1))
    heap.finalize()
    return heap.D, heap.I


def search_allowed(
    xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Exact search restricted to the positions where `allowed` (N,) is True: min(k, allowed)
    results per query, whatever the share of allowed rows; the allowed rows are copied out a
    block at a time (GATHER_BYTES), so no copy the size of the view is made."""
    positions = np.flatnonzero(allowed)
    k = min(k, len(positions))
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    block = max(1024, GATHER_BYTES // (4 * max(1, xb.shape[1])))
    if len(positions) <= block:
        scores, pos = search(xq, np.ascontiguousarray(xb[positions]), k)
        return scores, positions[pos]
    heap = faiss.ResultHeap(len(xq), k, keep_max=True)
    for start in range(0, len(positions), block):
        some = positions[start : start + block]
        scores, pos = search(xq, np.ascontiguousarray(xb[some]), k)
        heap.add_result(scores, some[pos])
    heap.finalize()
    return heap.D, heap.I
