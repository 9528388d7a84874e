"""Exact maximum-inner-product search over a memory-mapped (N, D) float32 matrix, with several
kernels and a router that sends each batch to the one measured fastest for its size.

Why several: the fastest exact kernel depends on the batch size and on which BLAS the machine
runs. FAISS's scan (one pass over the data per query, a heap per query) wins for single
queries; for a few queries, the same scan over blocks of rows that stay in cache while every
query of the batch reads them (one pass over memory per batch, not per query: measured 2x the
plain scan's throughput at 4-16 queries on a 100k x 128 view); for larger batches, a matrix
product wins, but the OpenBLAS inside the faiss-cpu wheel may run
old kernels on new CPUs (measured: 'Barcelona' on an AVX-512 EPYC, so FAISS's batched path was
no faster than one query at a time) while torch's MKL and numpy's OpenBLAS run AVX-512, and
even the layout of one product changes which BLAS wins (numpy_topk). So the router measures
every kernel at start-up, on this machine, and keeps the table.

All kernels return the same thing: (scores, positions), (nq, k), best first, k <= N. Under ties
they may pick different positions of equal score; every returned score is the exact inner
product of its position (within float rounding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import faiss
import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK_ROWS = 16384  # scores of a block stay in cache: (B, 16384) float32 is 1 MB at B = 16
Kernel = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def faiss_knn(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's exact kernel: a scan with a top-k heap per query when nq * d is below
    faiss.cvar.distance_compute_blas_threshold, sgemm with the wheel's own BLAS above it.
    That threshold is process-wide: the Router sets it once, before the first search."""
    scores, pos = faiss.knn(xq, xb, k, metric=faiss.METRIC_INNER_PRODUCT)
    return scores, pos


CACHE_BLOCK_BYTES = 1 << 21  # a block of the view that stays in cache while a batch scans it


def faiss_blocked(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's scan, block of rows by block of rows: each block is read from memory once per
    batch and stays in cache while every query of the batch scans it (the plain scan reads the
    whole view once per query). Each block's top-k are merged. Below the BLAS threshold only:
    above it FAISS runs its matrix product on each block."""
    block = max(256, CACHE_BLOCK_BYTES // (4 * max(1, xb.shape[1])))
    if xb.shape[0] <= block:
        return faiss_knn(xq, xb, k)
    parts = []
    for start in range(0, xb.shape[0], block):
        part = xb[start : start + block]
        s, i = faiss_knn(xq, part, min(k, part.shape[0]))
        parts.append((s, i + start))
    return _merged(parts, k)


def _merged(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top k, best first, of each part's top-k (scores, positions in the whole view)."""
    scores = np.concatenate([s for s, _ in parts], 1)
    pos = np.concatenate([i for _, i in parts], 1)
    if scores.shape[1] > k:
        keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        scores, pos = np.take_along_axis(scores, keep, 1), np.take_along_axis(pos, keep, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(scores, order, 1), np.take_along_axis(pos, order, 1)


HALVES_MIN_ROWS = 8192  # below this a second thread costs more than it saves
_half_pool: ThreadPoolExecutor | None = None


def _second_thread() -> ThreadPoolExecutor:
    global _half_pool
    if _half_pool is None:
        _half_pool = ThreadPoolExecutor(
            1, thread_name_prefix="faiss-half", initializer=faiss.omp_set_num_threads, initargs=(1,)
        )
    return _half_pool


def faiss_halves(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS's scan with the rows in two halves, the second scanned on a thread of its own
    while the caller scans the first (FAISS releases the GIL). A lone query is bound by one
    core's memory bandwidth; on an idle server the other core is free (measured on a 100k x 128
    view: 1.7-1.9 ms against 2.3-2.5 for the plain scan). The same work spread over two cores,
    so only for a search that has the server to itself: on a busy one, the second thread takes
    the core another search needs (measured: 2 workers at 32 connections fell from 1,170 to 770
    queries/s when every lone query was split)."""
    if xb.shape[0] < HALVES_MIN_ROWS:
        return faiss_knn(xq, xb, k)
    half = xb.shape[0] // 2
    second = _second_thread().submit(faiss_knn, xq, xb[half:], min(k, xb.shape[0] - half))
    s1, i1 = faiss_knn(xq, xb[:half], min(k, half))
    s2, i2 = second.result()
    return _merged([(s1, i1), (s2, i2 + half)], k)


def torch_blocked(
    xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """torch (MKL) matrix products on blocks of rows, top-k per block, merged. With `allowed`
    (N,) bool, other rows score -inf (k must not exceed the allowed count)."""
    q = torch.from_numpy(np.ascontiguousarray(xq, dtype=np.float32))  # (B, D)
    best_s: torch.Tensor | None = None
    best_i: torch.Tensor | None = None
    for start in range(0, xb.shape[0], BLOCK_ROWS):
        if allowed is not None and not allowed[start : start + BLOCK_ROWS].any():
            continue
        blk = torch.from_numpy(xb[start : start + BLOCK_ROWS])  # a view of the map, no copy
        s = q @ blk.T  # (B, rows)
        if allowed is not None:
            s[:, torch.from_numpy(~allowed[start : start + BLOCK_ROWS])] = -torch.inf
        best_s, best_i = _kept(best_s, best_i, s, start, k, dim=1)
    assert best_s is not None and best_i is not None
    return best_s.numpy(), best_i.numpy()


def _kept(
    best_s: torch.Tensor | None,
    best_i: torch.Tensor | None,
    scores: torch.Tensor,
    start: int,
    k: int,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k along `dim` of what was kept so far and of a block's `scores` (whose rows
    start at position `start` of the view), best first."""
    v, i = torch.topk(scores, min(k, scores.shape[dim]), dim=dim)
    i += start
    if best_s is None or best_i is None:
        return v, i
    cat_s, cat_i = torch.cat([best_s, v], dim), torch.cat([best_i, i], dim)
    best_s, idx = torch.topk(cat_s, k, dim=dim)
    return best_s, torch.gather(cat_i, dim, idx)


def numpy_blocked(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy (its own OpenBLAS) matrix products on blocks, argpartition per block, merged."""
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    rows = np.arange(len(xq))[:, None]
    best_s = np.full((len(xq), 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((len(xq), 0), dtype=np.int64)
    for start in range(0, xb.shape[0], BLOCK_ROWS):
        s = xq @ xb[start : start + BLOCK_ROWS].T  # (B, rows)
        kk = min(k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk] if kk < s.shape[1] else None
        if part is None:
            part = np.broadcast_to(np.arange(s.shape[1]), s.shape)
        best_s = np.concatenate([best_s, s[rows, part]], 1)
        best_i = np.concatenate([best_i, part + start], 1)
        if best_s.shape[1] > k:
            keep = np.argpartition(-best_s, k - 1, axis=1)[:, :k]
            best_s, best_i = best_s[rows, keep], best_i[rows, keep]
    order = np.argsort(-best_s, axis=1, kind="stable")
    return best_s[rows, order], best_i[rows, order]


def numpy_topk(xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's BLAS for the products, block by block, as (rows, B) = block @ queries.T (the
    block read as it lies in memory, the small query matrix the one packed), and torch's top-k
    down each column, merged. Why a kernel of its own: where numpy's OpenBLAS runs its
    SkylakeX kernels and FAISS's its 'Barcelona' ones (a Zen 5 EPYC with OPENBLAS_CORETYPE
    unset), it measured 1,580 / 2,440 / 3,130 queries/s at 8 / 16 / 32 queries on a 100k x 128
    view, against torch's 1,280 / 1,680 / 1,810 (whose MKL packs each block first) and
    numpy's own 840 / 1,360 / 1,620 (whose argpartition is slower than torch's top-k)."""
    q_t = np.ascontiguousarray(xq.T, dtype=np.float32)  # (D, B)
    best_s: torch.Tensor | None = None
    best_i: torch.Tensor | None = None
    for start in range(0, xb.shape[0], BLOCK_ROWS):
        s = torch.from_numpy(xb[start : start + BLOCK_ROWS] @ q_t)  # (rows, B)
        best_s, best_i = _kept(best_s, best_i, s, start, k, dim=0)  # (k, B)
    assert best_s is not None and best_i is not None
    return best_s.T.contiguous().numpy(), best_i.T.contiguous().numpy()


KERNELS: dict[str, Kernel] = {
    "faiss": faiss_knn,
    "faiss_blocked": faiss_blocked,
    "faiss_halves": faiss_halves,
    "torch": torch_blocked,
    "numpy": numpy_blocked,
    "numpy_topk": numpy_topk,
}
NEVER_BLAS = 2**31 - 1  # the threshold is a C int


def search(kernel: str, xq: np.ndarray, xb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, min(k, N)); empty when N or k is 0."""
    k = min(k, xb.shape[0])
    if k == 0 or len(xq) == 0:
        return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
    return KERNELS[kernel](xq, xb, k)


SUBSET_FRACTION = 0.25  # below this share of allowed rows, copy them out and search the copy


def search_allowed(
    kernel: str, xq: np.ndarray, xb: np.ndarray, k: int, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Exact search restricted to the positions where `allowed` (N,) is True: min(k, allowed)
    results per query, whatever the share of allowed rows.

    Few allowed rows are gathered into a small matrix and searched with `kernel`; many are
    searched in place by torch with the others' scores masked out, so that no large copy is
    made (FAISS's exact kernel takes no mask)."""
    positions = np.flatnonzero(allowed)
    k = min(k, len(positions))
    if k == 0 or len(xq) == 0:
        return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
    if len(positions) <= SUBSET_FRACTION * xb.shape[0]:
        scores, pos = KERNELS[kernel](xq, np.ascontiguousarray(xb[positions]), k)
        return scores, positions[pos]
    return torch_blocked(xq, xb, k, allowed)


@dataclass
class Router:
    """Batch size -> kernel, measured on this machine.

    FAISS counts as three candidates: its scan, its scan over cache-sized blocks, and its BLAS
    path. Since FAISS picks between scan and BLAS by a process-wide threshold on nq * d,
    calibration measures them apart (changing the threshold while nothing else searches) and
    then sets it once: to the batch size from which the BLAS path wins, or never; the scans
    then compete only below that size, the BLAS path only from it. Until calibrated, a rule
    that held on the machines seen so far: FAISS's scan for one query, its blocked scan for a
    few, torch for large batches (and the threshold keeps FAISS scanning).
    """

    table: dict[int, str] = field(default_factory=dict)
    timings: dict[str, dict[int, float]] = field(default_factory=dict)  # candidate -> size -> q/s
    blas_from: int | None = None  # FAISS takes its BLAS path from this batch size on

    @staticmethod
    def keep_faiss_scanning() -> None:
        """Uncalibrated: FAISS scans whatever the batch (torch takes the large batches)."""
        faiss.cvar.distance_compute_blas_threshold = NEVER_BLAS

    def kernel_for(self, batch: int) -> str:
        if not self.table:
            return "faiss" if batch == 1 else "faiss_blocked" if batch < 64 else "torch"
        sizes = [s for s in self.table if s <= batch]
        return self.table[max(sizes) if sizes else min(self.table)]

    def calibrate(
        self,
        dim: int,
        rows: int | None = None,
        budget_s: float = 0.01,
        set_threshold: bool = True,
    ) -> None:
        """Time every candidate at every batch size on a synthetic (rows, dim) matrix, by
        default one larger than the CPU's caches (as the views worth routing are: a matrix
        that fits in cache favours the plain scan). With set_threshold (the first calibration
        of a process, before any search runs), FAISS's paths are measured apart and the
        threshold is then set once; otherwise FAISS is measured as the threshold already set
        makes it run."""
        rows = rows or int(np.clip(CALIBRATION_BYTES // (4 * dim), 32768, 262144))
        rng = np.random.default_rng(0)
        xb = rng.standard_normal((rows, dim), dtype=np.float32)
        scan, blas = NEVER_BLAS, 0
        candidates: dict[str, tuple[Kernel, int | None, int]] = {
            "torch": (torch_blocked, None, CALIBRATION_SIZES[-1]),
            "numpy": (numpy_blocked, None, CALIBRATION_SIZES[-1]),
            "numpy_topk": (numpy_topk, None, CALIBRATION_SIZES[-1]),
        }
        if set_threshold:
            # The plain scan reads the view once per query: past a few queries it only loses.
            candidates |= {
                "faiss_scan": (faiss_knn, scan, 8),
                "faiss_blocked": (faiss_blocked, scan, CALIBRATION_SIZES[-1]),
                "faiss_blas": (faiss_knn, blas, CALIBRATION_SIZES[-1]),
            }
        else:
            candidates["faiss"] = (faiss_knn, None, CALIBRATION_SIZES[-1])
            candidates["faiss_blocked"] = (faiss_blocked, None, CALIBRATION_SIZES[-1])
        timings: dict[str, dict[int, float]] = {name: {} for name in candidates}
        dropped: set[str] = set()
        for b in CALIBRATION_SIZES:
            xq = rng.standard_normal((b, dim), dtype=np.float32)
            for name, (fn, threshold, largest) in candidates.items():
                if b > largest or name in dropped:
                    continue
                if threshold is not None:
                    faiss.cvar.distance_compute_blas_threshold = threshold
                timings[name][b] = _rate(fn, xq, xb, budget_s, warm=b == 1)
            # From 16 queries on (where rates have mostly stopped climbing with the batch), a
            # candidate at less than half the best rate is not measured at larger sizes: those
            # measurements cost seconds, and searches wait behind them.
            top = max(t[b] for t in timings.values() if b in t)
            if b >= 16:
                dropped |= {n for n, t in timings.items() if b in t and t[b] < top / 2}

        def fastest(b: int, names: list[str]) -> str:
            return max((n for n in names if b in timings[n]), key=lambda n: timings[n][b])

        names = list(timings)
        best = {b: fastest(b, names) for b in CALIBRATION_SIZES}
        if set_threshold:
            blas_sizes = [b for b in CALIBRATION_SIZES if best[b] == "faiss_blas"]
            self.blas_from = min(blas_sizes) if blas_sizes else None
            faiss.cvar.distance_compute_blas_threshold = (
                self.blas_from * dim if self.blas_from is not None else NEVER_BLAS
            )
            # Under the threshold FAISS scans; from it, every FAISS call takes the BLAS path.
            below = [n for n in names if n != "faiss_blas"]
            above = [n for n in names if n not in ("faiss_scan", "faiss_blocked")]
            best = {
                b: fastest(b, below if self.blas_from is None or b < self.blas_from else above)
                for b in CALIBRATION_SIZES
            }
        self.timings = timings
        faiss_paths = ("faiss_scan", "faiss_blas")
        self.table = {b: "faiss" if n in faiss_paths else n for b, n in best.items()}
        log.info("exact search kernels by batch size (d=%d): %s", dim, best)


CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALIBRATION_BYTES = 48 << 20  # more than the last-level caches of the CPUs seen so far


def _rate(fn: Kernel, xq: np.ndarray, xb: np.ndarray, budget_s: float, warm: bool = True) -> float:
    """Queries per second of fn on (xq, xb), k = 10 (after one warm call when `warm`)."""
    if warm:
        fn(xq, xb, 10)
    done, t0 = 0, time.perf_counter()
    while True:
        fn(xq, xb, 10)
        done += 1
        elapsed = time.perf_counter() - t0
        if elapsed > budget_s:
            return len(xq) * done / elapsed
