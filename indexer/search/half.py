"""Exact inner-product search over a memory-mapped (N, D) float16 matrix: a compact version's
views that are one modality's stored embeddings (indexer.build.compact).

Blocks of rows (all of them, or a filter's allowed ones) are widened to float32, which is
exact, and searched by indexer.search.exact (FAISS's own kernels); the blocks' results merge in
faiss.ResultHeap. Every score is the exact inner product of the query with the float16 row.
Widening a block costs less than the scan that follows it, and keeps one copy of the vectors
on disk and in the page cache: FAISS's own fp16 index (IndexScalarQuantizer QT_fp16) would
hold a second copy of the embeddings it searches (docs/guide.md, "Compact versions").
"""

from __future__ import annotations

import faiss
import numpy as np

from indexer.search import exact

BLOCK_BYTES = 16 << 20  # float32 bytes a block is widened into


def _block_rows(dim: int) -> int:
    return max(1024, BLOCK_BYTES // (4 * max(1, dim)))


def search(
    xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, k'), best first; k' = min(k, N or the allowed positions).
    `allowed` (N,) bool restricts the search to those positions."""
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    n = xb.shape[0]
    positions = None if allowed is None else np.flatnonzero(allowed)
    total = n if positions is None else len(positions)
    k = min(k, total)
    if k == 0 or len(xq) == 0:
        return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
    block = _block_rows(xb.shape[1])
    heap = faiss.ResultHeap(len(xq), k, keep_max=True)
    for start in range(0, total, block):
        stop = min(start + block, total)
        if positions is None:
            some = np.arange(start, stop, dtype=np.int64)
            rows = np.asarray(xb[start:stop], dtype=np.float32)
        else:
            some = positions[start:stop]
            rows = np.asarray(xb[some], dtype=np.float32)
        scores, pos = exact.search(xq, rows, k)
        heap.add_result(scores, np.where(pos >= 0, some[np.clip(pos, 0, None)], -1))
    heap.finalize()
    return heap.D, heap.I
