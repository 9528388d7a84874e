"""The batch size from which exact search runs matrix products instead of the blocked scan
(indexer.search.exact), measured once per machine, width and thread count, and shared by every
worker and every later start through a small file in a cache directory.

Why measured rather than a fixed rule: the two kernels cross at 8-16 queries on one CPU and at
32-64 on another (docs/benchmarks/serving.md), and a loaded server's batches fall in between.
Two kernels at five batch sizes cost about a second, paid by the first worker of a machine
(the others wait for its file under a lock), not by each worker at each start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from indexer.search import exact

log = logging.getLogger(__name__)

SIZES = (4, 8, 16, 32, 64)  # the batches a server forms under load
NEVER = 1 << 30  # products never win at the sizes measured: the blocked scan throughout
ROUND_S = 0.05  # each kernel at each size, after a warm call
SYNTHETIC_BYTES = 48 << 20  # more than the last-level caches seen: views worth choosing for are


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = ("model name", "cpu family", "model", "flags")
    return "|".join(line for line in info.splitlines()[:40] if line.split(":")[0].strip() in keep)


def signature(dim: int, threads: int) -> str:
    """What the choice depends on: the CPU and its cores, the libraries' versions, d, threads."""
    parts = [_cpu(), str(os.cpu_count()), torch.__version__, np.__version__, faiss.__version__]
    key = "\0".join([*parts, str(dim), str(threads)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _rate(fn: exact.Kernel, xq: np.ndarray, xb: np.ndarray) -> float:
    fn(xq, xb, 10)
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < ROUND_S or done == 0:
        fn(xq, xb, 10)
        done += 1
    return len(xq) * done / elapsed


def measure(dim: int) -> tuple[int, dict[int, tuple[float, float]]]:
    """(products_from, {batch: (blocked scan q/s, products q/s)}) on a synthetic view of
    width `dim`, on the calling thread with its thread settings."""
    rows = int(np.clip(SYNTHETIC_BYTES // (4 * dim), 32768, 262144))
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((rows, dim), dtype=np.float32)
    rates = {}
    for b in SIZES:
        xq = rng.standard_normal((b, dim), dtype=np.float32)
        rates[b] = (_rate(exact.blocked_scan, xq, xb), _rate(exact.product_topk, xq, xb))
    wins = [b for b in SIZES if rates[b][1] >= rates[b][0]]
    # From the smallest size at which the products win at that size and every larger one.
    start = next((b for b in SIZES if all(w in wins for w in SIZES if w >= b)), NEVER)
    return start, rates


def _lock(directory: Path) -> int | None:
    """An open, exclusively locked file in `directory` (released when closed), or None where
    the directory cannot hold one."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "choice.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.warning(
            "cannot keep the kernel choice in %s (%s): measuring it for this process",
            directory,
            exc,
        )
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _read(path: Path) -> int | None:
    try:
        value = json.loads(path.read_text())["products_from"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and value >= 1 else None


def products_from(dim: int, threads: int, directory: Path) -> int:
    """The batch size from which products win, from the machine's record or measured now
    (on the calling thread: call it where searches run, with their thread settings) and kept
    in `directory` (HCLIP_KERNELS_DIR). A directory that cannot be written only costs a
    measurement per call."""
    path = directory / f"exact-{signature(dim, threads)}.json"
    found = _read(path)
    if found is not None:
        return found
    fd = _lock(directory)
    try:
        found = _read(path)  # another worker may have measured it while this one waited
        if found is not None:
            return found
        t0 = time.perf_counter()
        start, rates = measure(dim)
        took = time.perf_counter() - t0
        log.info(
            "exact search: products from %s queries on (d=%d, %d threads), measured in %.2f s",
            start if start != NEVER else "no batch",
            dim,
            threads,
            took,
        )
        record = {
            "products_from": start,
            "dim": dim,
            "threads": threads,
            "rates": {b: {"blocked": r[0], "products": r[1]} for b, r in rates.items()},
        }
        with contextlib.suppress(OSError):
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, path)
        return start
    finally:
        if fd is not None:
            os.close(fd)
