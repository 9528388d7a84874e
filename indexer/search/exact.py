"""Exact maximum-inner-product search over a memory-mapped (N, D) float32 matrix.

Library kernels chosen by batch size: a lone query is FAISS's scan (faiss.knn: one pass over
the rows with a top-k heap, no temporary the size of the view); a few queries (below a
crossover measured per machine, indexer.search.crossover) are the same scan over blocks of rows
small enough to stay in cache while every query of the batch reads them, so that one pass over
memory serves the batch (a matrix product of a few rows is memory-bound too, and pays its
BLAS's set-up per block); a larger batch is a matrix product with torch's BLAS and torch's
top-k, over blocks of rows so that the scores of a block stay small. FAISS's own batched path
runs the BLAS bundled with its wheel, which some CPUs get only generic kernels of; torch's
dispatches on the CPU it finds.

A lone query on an otherwise idle machine is bound by one core's memory bandwidth: `parts`
scans slices of the rows on that many threads at once (FAISS lets go of the GIL) and merges
their top-k. FAISS's own OpenMP threads do the same, but waking them under the passive wait
policy a server needs costs more than they save (docs/benchmarks/serving.md).

Both return (scores, positions), (nq, k), best first, k <= N. Under ties they may pick
different positions of equal score; every returned score is the exact inner product of its
position (within float rounding).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import torch

MIN_PART_ROWS = 8192  # a slice smaller than this costs a thread more than it saves
# From this many queries on, torch's products, below it the blocked scan, unless the caller
# passes the crossover measured on its machine (indexer.search.crossover): a rule that held on
# the first CPUs measured, for the tuner and tools that do not measure.
SMALL_BATCH = 8
Kernel = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]
CACHE_BLOCK_BYTES = 1 << 21  # rows of the view that stay in cache while a batch scans them
BLOCK_ROWS = 16384  # scores of a block stay small: (B, 16384) float32 is 4 MB at B = 64
SUBSET_FRACTION = 0.25  # below this share of allowed rows, copy them out and search the copy


def scan(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's exact scan, a top-k heap per query (it takes its BLAS path only for batches
    far larger than the service forms)."""
    scores, pos = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
    return scores, pos


def blocked_scan(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """scan() over blocks of rows that stay in cache while every query of the batch scans them;
    each block's top-k merged."""
    block = max(256, CACHE_BLOCK_BYTES // (4 * max(1, xb.shape[1])))
    if xb.shape[0] <= block:
        return scan(xq, xb, k)
    found = [scan(xq, xb[s : s + block], min(k, xb.shape[0] - s))
             for s in range(0, xb.shape[0], block)]  # fmt: skip
    scores = np.concatenate([s for s, _ in found], 1)
    pos = np.concatenate([i + n * block for n, (_, i) in enumerate(found)], 1)
    keep = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, keep, 1), np.take_along_axis(pos, keep, 1)


_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(
                max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="scan-part",
                initializer=faiss.omp_set_num_threads, initargs=(1,),
            )  # fmt: skip
        return _helpers


def split_scan(xq: np.ndarray, xb: np.ndarray, k: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """scan() over `parts` slices of the rows at once, the first on the calling thread."""
    parts = min(parts, xb.shape[0] // MIN_PART_ROWS)
    if parts < 2:
        return scan(xq, xb, k)
    bounds = np.linspace(0, xb.shape[0], parts + 1).astype(int)
    slices = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
    pool = _helper_pool()
    futures = [pool.submit(scan, xq, xb[a:b], min(k, b - a)) for a, b in slices[1:]]
    a, b = slices[0]
    found = [scan(xq, xb[a:b], min(k, b - a))] + [f.result() for f in futures]
    scores = np.concatenate([s for s, _ in found], 1)
    pos = np.concatenate([i + start for (_, i), (start, _) in zip(found, slices, strict=True)], 1)
    keep = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, keep, 1), np.take_along_axis(pos, keep, 1)


def product_topk(
    xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """torch's matrix products on blocks of rows, top-k per block, merged. With `allowed`
    (N,) bool, other rows score -inf (k must not exceed the allowed count)."""
    q = torch.from_numpy(np.ascontiguousarray(xq, dtype=np.float32))  # (B, D)
    best_s: torch.Tensor | None = None
    best_i: torch.Tensor | None = None
    for start in range(0, xb.shape[0], BLOCK_ROWS):
        if allowed is not None and not allowed[start : start + BLOCK_ROWS].any():
            continue
        block = torch.from_numpy(xb[start : start + BLOCK_ROWS])  # a view of the map, no copy
        s = q @ block.T  # (B, rows)
        if allowed is not None:
            s[:, torch.from_numpy(~allowed[start : start + BLOCK_ROWS])] = -torch.inf
        v, i = torch.topk(s, min(k, s.shape[1]), dim=1)
        i += start
        if best_s is None or best_i is None:
            best_s, best_i = v, i
            continue
        cat_s, cat_i = torch.cat([best_s, v], 1), torch.cat([best_i, i], 1)
        best_s, idx = torch.topk(cat_s, k, dim=1)
        best_i = torch.gather(cat_i, 1, idx)
    assert best_s is not None and best_i is not None
    return best_s.numpy(), best_i.numpy()


def _empty(nq: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((nq, 0), np.float32), np.zeros((nq, 0), np.int64)


def search(
    xq: np.ndarray, xb: np.ndarray, k: int, parts: int = 1, products_from: int = SMALL_BATCH
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, min(k, N)); empty when N or k is 0. `parts`: the threads a
    lone query may scan on; `products_from`: the batch size from which products run."""
    k = min(k, xb.shape[0])
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    if len(xq) >= products_from:
        return product_topk(xq, xb, k)
    if len(xq) > 1:
        return blocked_scan(xq, xb, k)
    return split_scan(xq, xb, k, parts) if parts > 1 else scan(xq, xb, k)


def search_allowed(
    xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Exact search restricted to the positions where `allowed` (N,) is True: min(k, allowed)
    results per query, whatever the share of allowed rows.

    Few allowed rows are gathered into a small matrix and searched; many are searched in place
    with the others' scores masked out, so that no large copy is made."""
    positions = np.flatnonzero(allowed)
    k = min(k, len(positions))
    if k == 0 or len(xq) == 0:
        return _empty(len(xq))
    if len(positions) <= SUBSET_FRACTION * xb.shape[0]:
        scores, pos = search(xq, np.ascontiguousarray(xb[positions]), k)
        return scores, positions[pos]
    return product_topk(np.ascontiguousarray(xq, dtype=np.float32), xb, k, allowed)
