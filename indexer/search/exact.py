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

import faiss
import numpy as np

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
