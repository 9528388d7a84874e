"""The service's worker threads: one for searches, one per modality for encodes.

OpenMP keeps its thread count per thread, so each pool sets its own in an initializer that runs
in the thread itself; a setting made on the event loop's thread would not reach them. One
thread per encoder kind means that a slow image decode never delays an audio or text search.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import faiss
import torch

from app.services.core_share import CoreShare

log = logging.getLogger(__name__)


def search_thread_setup(faiss_threads: int, torch_threads: int) -> None:
    faiss.omp_set_num_threads(faiss_threads)
    torch.set_num_threads(torch_threads)  # batches are torch matrix products


def _torch_thread(threads: int) -> None:
    torch.set_num_threads(threads)


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
        if self.core_share is not None:
            self.core_share.close()
