"""Concurrent searches on one view gathered into one FAISS call.

On this CPU a batch of 64 queries costs little more than one (BLAS instead of one scan per
query), so while a FAISS call runs, the requests that arrive queue up and go together in the
next call. A lone request is dispatched at once: nobody waits for a batch that is not coming,
unless HCLIP_BATCH_WAIT_MS asks for a short wait.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from app.metrics import Metrics
from indexer.reader import View

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    xq: np.ndarray  # (D,)
    k: int
    future: asyncio.Future[tuple[np.ndarray, np.ndarray]]


class SearchBatcher:
    def __init__(
        self, view: View, executor: Executor, metrics: Metrics, max_batch: int, wait_s: float
    ):
        self.view = view
        self.executor = executor
        self.metrics = metrics
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._pending: list[_Pending] = []
        self._draining = False

    async def search(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of one query vector, best first."""
        future: asyncio.Future[tuple[np.ndarray, np.ndarray]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append(_Pending(xq, k, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                if self.wait_s and len(self._pending) < self.max_batch:
                    await asyncio.sleep(self.wait_s)
                batch, self._pending = (
                    self._pending[: self.max_batch],
                    self._pending[self.max_batch :],
                )
                xq = np.stack([p.xq for p in batch])  # (B, D)
                kmax = max(p.k for p in batch)
                try:
                    scores, rows = await loop.run_in_executor(
                        self.executor, self.view.search, xq, kmax
                    )
                except Exception as exc:  # hand the failure to every waiting request
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                self.metrics.batch_size.observe(len(batch))
                for i, p in enumerate(batch):
                    if not p.future.done():
                        p.future.set_result((scores[i, : p.k], rows[i, : p.k]))
        finally:
            self._draining = False
