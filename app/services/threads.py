"""The service's worker threads: one for searches, one per modality for encodes, and one that
runs every torch call given more than one thread (TeamThread).

OpenMP keeps its thread count per thread, so each pool sets its own in an initializer that runs
in the thread itself; a setting made on the event loop's thread would not reach them. One
thread per encoder kind means that a slow image decode never delays an audio or text search.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import faiss
import torch

from app.services.core_share import CoreShare
from models.machine import usable_cores

log = logging.getLogger(__name__)
T = TypeVar("T")


def search_thread_setup(faiss_threads: int, torch_threads: int) -> None:
    faiss.omp_set_num_threads(faiss_threads)
    torch.set_num_threads(torch_threads)  # batches are torch matrix products


def _torch_thread(threads: int) -> None:
    torch.set_num_threads(threads)


def on_threads(threads: int, call: Callable[[], T]) -> T:
    """`call()` on this thread with `threads` torch threads, without autograd bookkeeping."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        return call()


# Elements per thread of the tensor that starts a team: several times torch's grain size
# (32,768), so that the region takes every thread it is given.
TEAM_START_ELEMENTS = 1 << 17


def place_team(threads: int, core: int) -> bool:
    """Start this thread's OpenMP team of `threads`, this thread on one usable core (`core`,
    modulo their number) and the team's other threads on the others; False where the cores
    cannot be set (one core, no affinity calls), and the team is left to the scheduler.

    Unplaced, a team of one thread per core loses lone small forwards to the scheduler: a
    woken OpenMP thread can land on its master's core while another idles, and every region
    of the forward then waits on the two sharing it (lone MiniLM queries through torch on 2
    cores, 2 workers: 18 to 20 ms unplaced, 12 to 15 placed; docs/benchmarks/tower_serving.md).
    libgomp's threads take the affinity of the thread that starts them, so they start while
    this thread excludes its own core, and this thread takes that core after."""
    if threads < 2 or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return False
        own = cores[core % len(cores)]
        os.sched_setaffinity(0, [c for c in cores if c != own])
        try:
            torch.set_num_threads(threads)
            torch.ones(threads * TEAM_START_ELEMENTS).add_(1.0)
        finally:
            os.sched_setaffinity(0, [own])
    except OSError as exc:  # a CPU set changed under the process (a container's): unplaced
        log.warning("the torch team's threads were left unplaced: %s", exc)
        return False
    return True


class TeamThread:
    """The one thread of a worker that runs torch calls on more than one thread.

    torch's OpenMP keeps a team of threads for each thread that calls it, and libgomp stops
    spinning between parallel regions in every team once the teams of a process hold more
    threads than there are cores: each region then waits for its threads to wake. Two encode
    threads that had each run a lone query on every core made ViT-B/16's later lone forwards
    an eighth slower (docs/benchmarks/tower_serving.md). So a call given more than one thread
    runs here when this thread is free. A call that finds it busy gets `busy_threads`, the
    worker's fixed share. One thread (each worker has a core) runs on the caller's thread and
    starts no team. More (workers fewer than cores) run on a thread made for the call, whose
    team libgomp frees when it ends: while the two calls share the worker's cores, libgomp
    stops spinning, as it should (one worker on two cores answering text and images at once: a
    spinning team beside a one-thread call took text from 288 to 92 q/s); once they are done,
    the team thread's team spins again. A team left on a long-lived thread would slow every
    later lone forward as much as the two encode threads did.

    Its first call starts a team of `size` threads (the most a call is given) placed on the
    cores (place_team), this thread on core `core`: each worker gives its own, so that the
    workers' team threads sit on different cores."""

    def __init__(self, core: int = 0, size: int | None = None) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch-team")
        self._free = threading.Lock()
        self.core = core
        self.size = size or usable_cores()
        self._started = False

    def _on_team(self, threads: int, call: Callable[[], T]) -> T:
        if not self._started:
            self._started = True
            place_team(max(threads, self.size), self.core)
        return on_threads(threads, call)

    def run(self, threads: int, call: Callable[[], T], busy_threads: int = 1) -> T:
        if threads > 1 and self._free.acquire(blocking=False):
            try:
                return self._executor.submit(self._on_team, threads, call).result()
            finally:
                self._free.release()
        n = min(threads, busy_threads)
        if n == 1:
            return on_threads(1, call)
        with ThreadPoolExecutor(1, thread_name_prefix="torch-overlap") as once:
            return once.submit(on_threads, n, call).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


class WorkerPools:
    def __init__(
        self, search_threads: int, torch_threads: int, core_share: CoreShare | None = None
    ):
        self.torch_threads = torch_threads
        self.core_share = core_share  # None: every encode keeps torch_threads
        self.search = ThreadPoolExecutor(
            1,
            thread_name_prefix="search",
            initializer=search_thread_setup,
            initargs=(search_threads, torch_threads),
        )
        self._encoders: dict[str, ThreadPoolExecutor] = {}
        if core_share is None:  # every call keeps torch_threads
            self.team = TeamThread(os.getpid(), torch_threads)
        else:  # a worker's slot among the server's picks its team thread's core
            self.team = TeamThread(core_share.slot, core_share.cores)

    def encoder(self, modality: str) -> ThreadPoolExecutor:
        """The pool that encodes `modality` (created on first use; modalities come with the
        model, which is loaded after start-up)."""
        pool = self._encoders.get(modality)
        if pool is None:
            pool = ThreadPoolExecutor(
                1,
                thread_name_prefix=f"encode-{modality}",
                initializer=_torch_thread,
                initargs=(self.torch_threads,),
            )
            self._encoders[modality] = pool
        return pool

    def shutdown(self) -> None:
        self.search.shutdown(wait=True)
        for pool in self._encoders.values():
            pool.shutdown(wait=True)
        self.team.shutdown()
        if self.core_share is not None:
            self.core_share.close()
