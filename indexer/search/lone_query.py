"""A lone exact query scanned over slices of the view on several threads at once, its slices'
results merged in faiss.ResultHeap.

Why: FAISS spreads its scan over queries, so one query runs on one core (on two OpenMP threads
it ran three times slower still), while the cores beside it idle; a memory-mapped view of 1M x
256 took 47 ms a lone query served on one core, 38 ms split in two (docs/benchmarks/serving.md,
"A lone query"). FAISS lets go of the GIL while it scans, so plain threads do it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np

from indexer.search import exact

MIN_PART_ROWS = 65536  # a slice smaller than this costs a thread hop more than it saves
_threads = 1
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def use_threads(threads: int) -> None:
    """A lone exact query may scan on this many threads (process-wide; 1: on its own)."""
    global _threads
    _threads = max(1, threads)


def _helpers(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < count:  # grows with use_threads()
            _pool, _pool_size = ThreadPoolExecutor(
                count, thread_name_prefix="lone-scan",
                initializer=faiss.omp_set_num_threads, initargs=(1,),
            ), count  # fmt: skip
        return _pool


def search(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """exact.search for one query, over slices of the rows on up to use_threads() threads
    (the first on the calling thread)."""
    parts = min(_threads, xb.shape[0] // MIN_PART_ROWS)
    k = min(k, xb.shape[0])
    if len(xq) != 1 or parts < 2 or k == 0:
        return exact.search(xq, xb, k)
    bounds = np.linspace(0, xb.shape[0], parts + 1).astype(np.int64)
    slices = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
    pool = _helpers(parts - 1)
    futures = [pool.submit(exact.search, xq, xb[a:b], k) for a, b in slices[1:]]
    first, end = slices[0]
    found = [exact.search(xq, xb[first:end], k)] + [f.result() for f in futures]
    heap = faiss.ResultHeap(1, k, keep_max=True)
    for (start, _), (scores, pos) in zip(slices, found, strict=True):
        heap.add_result(scores, np.where(pos >= 0, pos + start, -1))
    heap.finalize()
    return heap.D, heap.I
