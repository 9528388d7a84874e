"""Concurrent requests gathered into one call on a worker thread: FAISS searches and encodes.

On this CPU a batch of 64 queries costs little more than one (BLAS instead of one scan per
query), and a hop to a worker thread costs about half a millisecond whatever it carries. So
while a call runs, the requests that arrive queue up and go together in the next call. A lone
request is dispatched at once: nobody waits for a batch that is not coming, unless
HCLIP_BATCH_WAIT_MS asks for a short wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from app.errors import InvalidInput
from indexer.reader import View
from models.inputs import InputError, decode
from models.model import MultimodalModel

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """`run_batch(items)` runs on the executor and returns one result or exception per item.

    With no executor it runs inline, on the event loop: only for work cheaper than a thread hop.
    """

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R | Exception]],
        executor: Executor | None,
        max_batch: int,
        wait_s: float,
        on_batch: Callable[[int], None] | None = None,
    ):
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.on_batch = on_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        if not self._draining:
            self._draining = True
            self._task = loop.create_task(self._drain())  # held: the loop keeps weak refs
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                if self.wait_s and len(self._pending) < self.max_batch:
                    await asyncio.sleep(self.wait_s)
                batch = self._pending[: self.max_batch]
                self._pending = self._pending[self.max_batch :]
                items = [item for item, _ in batch]
                try:
                    if self.executor is None:
                        results = self.run_batch(items)
                    else:
                        results = await loop.run_in_executor(self.executor, self.run_batch, items)
                except Exception as exc:  # the whole call failed: every waiter learns why
                    results = [exc] * len(batch)
                if self.on_batch:
                    self.on_batch(len(batch))
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._draining = False


SearchResult = tuple[np.ndarray, np.ndarray]  # (scores, rows) of one query, best first


def search_batcher(
    view: View, executor: Executor, max_batch: int, wait_s: float, on_batch: Callable[[int], None]
) -> MicroBatcher[tuple[np.ndarray, int], SearchResult]:
    """Items are (query vector (D,), k)."""

    def run(items: list[tuple[np.ndarray, int]]) -> list[SearchResult | Exception]:
        xq = np.stack([x for x, _ in items])  # (B, D)
        scores, rows = view.search(xq, max(k for _, k in items))
        return [(scores[i, :k], rows[i, :k]) for i, (_, k) in enumerate(items)]

    return MicroBatcher(run, executor, max_batch, wait_s, on_batch)


def encode_batcher(
    model: MultimodalModel, modality: str, executor: Executor, max_batch: int, wait_s: float
) -> MicroBatcher[Any, np.ndarray]:
    """Items are raw inputs; results are (d,) float32 embeddings, or the item's own error.

    A `vector` encoder is a small MLP (about 0.2 ms for one input here), cheaper than the hop to
    a worker thread and back (about 0.6 ms), so it runs inline; the other kinds go to `executor`.
    """
    cfg = model.cfg.modalities[modality]

    def run(values: list[Any]) -> list[np.ndarray | Exception]:
        out: list[np.ndarray | Exception] = []
        decoded, where = [], []
        for i, value in enumerate(values):
            try:
                decoded.append(decode(value, cfg, base_dir=None))
                where.append(i)
                out.append(np.empty(0))
            except InputError as exc:
                out.append(InvalidInput(f"query.{modality}: {exc}"))
        if decoded:
            with torch.no_grad():
                embs = model.encode(modality, decoded).numpy().astype(np.float32)  # (n, d)
            for j, i in enumerate(where):
                out[i] = embs[j]
        return out

    return MicroBatcher(run, None if cfg.kind == "vector" else executor, max_batch, wait_s)
