"""Concurrent requests gathered into one call: a view's searches (with their query factors) and
a modality's encodes.

While a call runs, the requests that arrive queue up and go together in the next call; a lone
request is dispatched at once, unless HCLIP_BATCH_WAIT_MS asks for a short wait. A tower's
encoder also holds a call under load (`hold_share`): after a call of n inputs, the next waits
until n are queued again, for at most a share of that call's time (and 50 ms). The clients the
last call answered are then sending their next queries; dispatching the first of them alone
would cost a tower call for one input (MiniLM: 3x an input's share of a call of 12) and split
the rest.

Three guarantees hold whatever one item does:
- an item's failure is its own: `run_batch` answers per item, and if the whole call raises, the
  batch is split and retried item by item, so a bad item fails only its request;
- the queue is bounded (`max_pending`): past it, submit raises Overloaded at once (a 503 with
  Retry-After) instead of growing memory and latency without bound;
- a request that gives up (its deadline passed, its client left) cancels its future, and a
  cancelled item is dropped before it reaches a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from app.core import timing
from app.core.errors import Overloaded
from app.services.core_share import CoreShare
from app.services.threads import TeamThread
from indexer.search.view import Searchable
from models.encoders import decode
from models.heads import Head
from models.limits import InputError, InputLimits
from models.model import MultimodalModel

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
GATHER_TURNS = 8  # at most this many turns of the event loop spent gathering a batch
# A tower's call under load waits at most this share of the last call's time, and at most
# HOLD_MAX_S, for the inputs the last call answered to come back: that bounds what a lone
# query arriving just after a burst pays, and is many times the few ms a cohort of clients
# takes to send again.
ENCODE_HOLD_SHARE = 0.25
HOLD_MAX_S = 0.05


class Timed(list[R | Exception]):
    """A call's results, one per item, with the parts of the call it timed where it ran (a
    stage's metric -> seconds): each request of the batch is told them beside the call's own
    time, so that what the call spent off the event loop shows apart from the hops to it."""

    def __init__(self, results: Sequence[R | Exception], stages: dict[str, float]):
        super().__init__(results)
        self.stages = stages


@dataclass(slots=True, eq=False)
class _Queued(Generic[T, R]):
    """An item while it waits, then the call that took it: when it began, how long it took,
    how many items it held (0 until then), and the parts it timed (Timed)."""

    item: T
    future: asyncio.Future[R]
    queued: float  # time.perf_counter() at submit
    started: float = 0.0
    took: float = 0.0
    batch: int = 0
    parts: dict[str, float] | None = None


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
        max_pending: int = 1024,
        name: str = "batcher",
        on_loop: bool = False,
        hold_share: float = 0.0,
        stage: tuple[str, str] | None = None,
    ):
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.on_batch = on_batch
        self.max_pending = max_pending
        self.name = name
        self.on_loop = on_loop  # run on the event loop even with an executor (see search_batcher)
        self.hold_share = hold_share
        self.stage = stage  # (metric, description) in the requests' Server-Timing
        self._pending: list[_Queued[T, R]] = []
        self._last = (0, 0.0, 0.0)  # the last call: its inputs, when it ended, how long it took
        self._wanted = 0  # submit wakes the held call once this many are queued
        self._enough: asyncio.Future[None] | None = None
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def submit(self, item: T) -> R:
        if len(self._pending) >= self.max_pending:
            raise Overloaded(
                f"{self.name}: {self.max_pending} requests already queued (HCLIP_MAX_PENDING)"
            )
        loop = asyncio.get_running_loop()
        queued = _Queued(item, loop.create_future(), time.perf_counter())
        self._pending.append(queued)
        enough = self._enough
        if enough is not None and not enough.done() and len(self._pending) >= self._wanted:
            enough.set_result(None)
        if not self._draining:
            self._draining = True
            self._task = loop.create_task(self._drain())  # held: the loop keeps weak refs
        try:
            return await queued.future  # cancelling the awaiting task cancels it: item dropped
        finally:
            if self.stage is not None and queued.batch:
                metric, desc = self.stage
                timing.record(f"{metric}-wait", desc, queued.started - queued.queued)
                timing.record(metric, desc, queued.took, queued.batch)
                for part, seconds in (queued.parts or {}).items():
                    timing.record(part, desc, seconds, queued.batch)

    async def _call(self, items: list[T]) -> Sequence[R | Exception]:
        if self.executor is None or self.on_loop:
            return self.run_batch(items)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.run_batch, items)

    async def _run(self, items: list[T]) -> Sequence[R | Exception]:
        try:
            return await self._call(items)
        except Exception as exc:
            if len(items) == 1:
                return [exc]
            # Which item broke the call is unknown: each gets a call of its own.
            log.warning(
                "%s: a batch of %d failed (%r); retrying one by one", self.name, len(items), exc
            )
            out: list[R | Exception] = []
            for item in items:
                out.extend(await self._run([item]))
            return out

    async def _hold(self) -> None:
        """Under load (the last call took several inputs), wait until as many are queued again,
        or until `hold_share` of the last call's time (HOLD_MAX_S at most) has passed since it
        ended."""
        size, ended, took = self._last
        wanted = min(size, self.max_batch)
        if not self.hold_share or wanted < 2 or len(self._pending) >= wanted:
            return
        left = ended + min(self.hold_share * took, HOLD_MAX_S) - time.perf_counter()
        if left <= 0:
            return
        self._wanted = wanted
        self._enough = asyncio.get_running_loop().create_future()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._enough
        finally:
            self._enough = None

    async def _drain(self) -> None:
        try:
            while self._pending:
                # Requests already being handled on this event loop (parsed, encoding) reach
                # this queue within a few of its turns: while each turn brings more, wait for
                # them, so that under load a call takes what is in flight instead of one query
                # (one query costs a scan of the whole view, as a batch of several does). A lone
                # request pays one turn of the loop, a few microseconds.
                for _ in range(GATHER_TURNS):
                    if len(self._pending) >= self.max_batch:
                        break
                    before = len(self._pending)
                    await asyncio.sleep(0)
                    if len(self._pending) == before:
                        break
                if self.wait_s and len(self._pending) < self.max_batch:
                    await asyncio.sleep(self.wait_s)
                await self._hold()
                live = [q for q in self._pending if not q.future.done()]
                batch, self._pending = live[: self.max_batch], live[self.max_batch :]
                if not batch:
                    continue
                started = time.perf_counter()
                results = await self._run([q.item for q in batch])
                ended = time.perf_counter()
                self._last = (len(batch), ended, ended - started)
                if self.on_batch:
                    self.on_batch(len(batch))
                parts = results.stages if isinstance(results, Timed) else None
                for q, result in zip(batch, results, strict=True):
                    q.started, q.took, q.batch = started, ended - started, len(batch)
                    q.parts = parts
                    if q.future.done():
                        continue
                    if isinstance(result, Exception):
                        q.future.set_exception(result)
                    else:
                        q.future.set_result(result)
        finally:
            self._draining = False


SearchResult = tuple[np.ndarray, np.ndarray]  # (scores, rows) of one query, best first
NON_FINITE = "the encoder's output is not finite for this input (are its values too large?)"


@dataclass(frozen=True)
class SearchItem:
    embs: dict[str, np.ndarray]  # the view's query modalities -> (d,) embeddings
    k: int
    filter: dict[str, Any] | None = None  # validated against the version's fields
    effort: int | None = None  # an approximate index's ef_search or nprobe
    field: str = "query"  # where the values came from, named if the factor is not finite


class NotFiniteQuery(InputError):
    """The query factor overflowed: the request's values are to blame."""


def query_factors(head: Head, view: Searchable, items: list[SearchItem]) -> np.ndarray:
    """(B, D) float32: the head's query factors of a batch, computed in one call."""
    embs = {m: torch.from_numpy(np.stack([it.embs[m] for it in items])) for m in view.query}
    with torch.inference_mode():  # no autograd bookkeeping on the serving path
        return head.query_factor(embs, view.query).numpy().astype(np.float32, copy=False)


def search_batcher(
    view: Searchable,
    head: Head,
    executor: Executor,
    max_batch: int,
    wait_s: float,
    on_batch: Callable[[int], None],
    max_pending: int = 1024,
    mask_of: Callable[[Any, dict[str, Any]], Any] | None = None,
    on_loop: bool = False,
) -> MicroBatcher[SearchItem, SearchResult]:
    """A batch's query factors come from the head in one call; its plain queries go to the
    view together, a query with a filter or its own effort on its own, its filter evaluated
    where the batch runs (a pass over the field columns): on the search thread, or with
    `on_loop` on the event loop itself. A worker with about a core of its own (HCLIP_WORKERS at
    least the cores) searches on its loop: a scan then holds the loop, the requests that arrive
    meanwhile wait in the socket, and the next scan takes all of them; on a thread, the loop
    and the scan share that core and the next scan starts with the first request back (1M x
    256, 2 workers, 32 connections: docs/benchmarks/serving.md, "Batches")."""

    def run(items: list[SearchItem]) -> list[SearchResult | Exception]:
        xq = query_factors(head, view, items)  # (B, D)
        finite = np.isfinite(xq).all(axis=1)
        out: list[SearchResult | Exception] = [
            (np.empty(0), np.empty(0))
            if ok
            else NotFiniteQuery(f"{it.field}: the query's vector is not finite (values too large?)")
            for it, ok in zip(items, finite.tolist(), strict=True)
        ]
        plain = [i for i, it in enumerate(items) if it.filter is None and it.effort is None]
        plain = [i for i in plain if finite[i]]
        if plain:
            k_max = max(items[i].k for i in plain)
            scores, rows = view.search(xq[plain], k_max)
            for j, i in enumerate(plain):
                out[i] = (scores[j, : items[i].k], rows[j, : items[i].k])
        for i, it in enumerate(items):
            if (it.filter is None and it.effort is None) or not finite[i]:
                continue
            allowed = None
            if it.filter is not None:
                assert mask_of is not None
                allowed = mask_of(view, it.filter)
            scores, rows = view.search(xq[i : i + 1], it.k, allowed, it.effort)
            out[i] = (scores[0], rows[0])
        return out

    return MicroBatcher(
        run, executor, max_batch, wait_s, on_batch, max_pending, name=f"view {view.name!r}",
        on_loop=on_loop, stage=("search", view.name),
    )  # fmt: skip


def encode_batcher(
    model: MultimodalModel,
    modality: str,
    executor: Executor,
    max_batch: int,
    wait_s: float,
    limits: InputLimits,
    max_pending: int = 1024,
    on_batch: Callable[[int], None] | None = None,
    core_share: CoreShare | None = None,
    team: TeamThread | None = None,
    threads: int = 1,
) -> MicroBatcher[Any, np.ndarray]:
    """Items are raw inputs (or, for `vector`, the tensors the request's checks decoded);
    results are (d,) float32 embeddings, or the item's own InputError, which the caller names
    with its field. A `vector` encoder is a small MLP, cheaper than a hop to a thread and back:
    it runs inline on the event loop; the other kinds go to `executor`, each call with the
    threads `core_share` gives it (None: `threads`), on `team`'s thread where it is given more
    than one and that thread is free (towers computed by torch: TeamThread says why)."""
    cfg = model.cfg.modalities[modality]
    share = None if cfg.kind == "vector" else core_share
    team = None if cfg.kind == "vector" else team

    def forward(decoded: list[Any]) -> tuple[np.ndarray, float]:
        """(n, d) embeddings and the seconds the model took, timed on the thread it ran on."""
        t0 = time.perf_counter()
        embs = model.encode(modality, decoded).numpy().astype(np.float32)
        return embs, time.perf_counter() - t0

    def encode(decoded: list[Any]) -> tuple[np.ndarray, float]:
        with contextlib.ExitStack() as stack:
            n = threads if share is None else stack.enter_context(share.threads(len(decoded)))
            if team is not None:
                floor = threads if share is None else share.floor  # the worker's fixed share
                return team.run(n, functools.partial(forward, decoded), busy_threads=floor)
            if share is not None:
                torch.set_num_threads(n)
            with torch.inference_mode():
                return forward(decoded)

    def run(values: list[Any]) -> list[np.ndarray | Exception]:
        out: list[np.ndarray | Exception] = []
        decoded, where = [], []
        t0 = time.perf_counter()
        for i, value in enumerate(values):
            try:
                # A JSON body holds no tensor: a tensor here was decoded by the checks.
                item = (
                    value if isinstance(value, torch.Tensor) else decode(value, cfg, None, limits)
                )
                decoded.append(item)
                where.append(i)
                out.append(np.empty(0))
            except InputError as exc:
                out.append(exc)
        # raw inputs' decode (base64, files; a tower's image resized and normalised by its
        # processor, its audio resampled), then the model's call: a text's tokenizer, the
        # tower, the head
        stages = {"decode": time.perf_counter() - t0}
        if decoded:
            embs, stages["forward"] = encode(decoded)
            finite = np.asarray(np.isfinite(embs).all(axis=1), dtype=bool)
            for j, i in enumerate(where):
                # Values near float32's limit overflow inside the encoder: the input's fault.
                out[i] = embs[j] if bool(finite[j]) else InputError(NON_FINITE)
        # a `vector` call runs inline and is all model: its `encode` says what it took
        return out if cfg.kind == "vector" else Timed(out, stages)

    return MicroBatcher(
        run,
        None if cfg.kind == "vector" else executor,
        max_batch,
        wait_s,
        on_batch,
        max_pending=max_pending,
        name=f"{modality} encoder",
        hold_share=0.0 if cfg.kind == "vector" else ENCODE_HOLD_SHARE,
        stage=("encode", modality),
    )
