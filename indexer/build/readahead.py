"""Checked chunks ahead of the encoder: a pool of reader processes checks chunks
(indexer.ingest.checks) while the caller encodes the ones before, and hands them back in input
order.

Checking JSON Lines is Python that holds the GIL, so it runs in processes
(concurrent.futures' pool), each with a GIL of its own; their number comes from the machine's
cores (indexer.build.local). The workers are forked, so they inherit the model and the checker
instead of unpickling them, and only from a process that runs no other Python thread (a fork
copies one thread; a lock another thread held would stay locked in the child). Otherwise, or
with no worker asked for, the chunks are checked here, in turn with the encoding.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def forkable() -> bool:
    """fork exists here, and no Python thread runs but this one (a Ray driver runs several)."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


_job: Callable[[Any], Any] | None = None  # what a worker applies, set by the initializer


def _start(fn: Callable[[Any], Any], parent: int) -> None:
    global _job
    _die_with(parent)
    _job = fn


def _apply(item: Any) -> Any:
    assert _job is not None
    return _job(item)


def _die_with(parent: int) -> None:
    """A SIGKILLed build takes its readers with it (Linux): none outlives the job holding a copy
    of the index root's lock."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above ran
        os._exit(1)


def ahead(
    fn: Callable[[T], R], items: Iterable[T], workers: int, depth: int
) -> Generator[R, None, None]:
    """fn(item) for every item, in order, computed by `workers` forked processes with up to
    `depth` items in flight; here, one by one, when workers is 0 or forking is unsafe. The
    workers start now, before the caller starts threads of its own. An error of fn is raised at
    its item; closing the generator cancels what has not started."""
    if workers < 1 or not forkable():
        return (fn(item) for item in items)
    ctx = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, ctx, initializer=_start, initargs=(fn, os.getpid()))
    source = iter(items)
    pending: deque[Future[R]] = deque()
    try:
        for item in itertools.islice(source, max(depth, 1)):
            pending.append(pool.submit(_apply, item))  # the first submit forks the workers
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return _in_order(pool, source, pending)


def _in_order(
    pool: ProcessPoolExecutor, source: Iterator[T], pending: deque[Future[R]]
) -> Generator[R, None, None]:
    try:
        while pending:
            done = pending.popleft()
            item = next(source, _END)
            if item is not _END:
                pending.append(pool.submit(_apply, item))
            yield _result(done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()


def _result(future: Future[R]) -> R:
    try:
        return future.result()
    except BrokenProcessPool:
        raise RuntimeError("a reader process stopped (killed, or out of memory?)") from None
