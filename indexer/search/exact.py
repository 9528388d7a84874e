"""Exact maximum-inner-product search over a memory-mapped (N, D) float32 matrix, through FAISS's
own entry points: `faiss.knn` (its scan with a top-k heap per query for a few queries, its BLAS
products for a batch, blocked so no temporary the size of the view is made), and for a filter
the allowed rows gathered block by block and merged in `faiss.ResultHeap`. Threads are FAISS's
(faiss.omp_set_num_threads, HCLIP_FAISS_THREADS in the service).

Both return (scores, positions), (nq, k), best first. Under ties they may pick different
positions of equal score; every returned score is the exact inner product of its position
(within float rounding).
"""

from __future__ import annotations

import faiss
import numpy as np

GATHER_BYTES = 16 << 20  # allowed rows copied out per block under a filter


def _empty(nq: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((nq, 0), np.float32), np.zeros((nq, 0), np.int64)


def search(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, min(k, N)); empty when N or k is 0."""
    k = min(k, xb.shape[0])
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    scores, pos = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
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
