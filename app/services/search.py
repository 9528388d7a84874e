"""The one search path, after the checks (app.services.checks): cache -> encode -> query
factor -> search -> format.

The routes call SearchService with a checked request (each query of POST /v1/search/batch
too) and get the response body's bytes back, or an ApiError.

- cache: results under the version and a hash of the checked request (docs/design.md §7);
- encode: each raw input through its modality's batcher (query embeddings cached by model
  fingerprint and input), given embeddings as they are;
- query factor and search: in the view's batcher (app.services.batching), the head's query
  factor for a whole batch in one call, then the view's search;
- format: the results with each record's payload spliced in as the JSON bytes it is stored as.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar, cast

import numpy as np
import orjson

from app.core.errors import ApiError, BackendDown, DeadlineExceeded, InvalidInput, envelope
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.services.batching import SearchItem
from app.services.cache import Cache, NoCache
from app.services.checks import CheckedEmbed, CheckedSearch, as_api_error
from app.services.versions import ServingVersion
from indexer.store.artifact import BackendUnavailable
from models.limits import InputError

T = TypeVar("T")


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def digest(obj: Any) -> str:
    """A hash of the canonical JSON form: key order and whitespace do not matter."""
    return _sha(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS))


def input_digest(value: Any) -> str:
    """The hash of one raw input: the embedding cache's key and a part of the result cache's."""
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else orjson.dumps(value)
    return _sha(raw)


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """All results, or the first error once every awaitable has finished (none is left
    running unobserved)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return cast(list[T], results)


class SearchService:
    def __init__(self, settings: Settings, metrics: Metrics, cache: Cache):
        self.settings = settings
        self.metrics = metrics
        self.cache = cache

    # -- search -------------------------------------------------------------------------------

    async def search(self, serving: ServingVersion, c: CheckedSearch) -> bytes:
        """One search, answered as the response body's bytes (errors raise ApiError). The
        result cache's key holds everything the answer depends on (replicas that share a Redis
        are meant to share their settings). With no cache, nothing is hashed."""
        if isinstance(self.cache, NoCache):
            return b'{"cached":false,' + (await self._answer(serving, c, None))[1:]
        s = self.settings
        # Each raw input is hashed once: its digest keys both caches.
        digests = {m: input_digest(v) for m, v in c.query.items()}
        given = {m: _sha(v.tobytes()) for m, v in c.given.items()}
        request = {"q": digests, "e": given, "k": c.k, "f": c.filter, "x": c.effort}
        key = f"{s.cache_prefix}:res:{serving.version}:{digest(request)}"
        hit = await self.cache.get(key)
        if hit is not None:
            self.metrics.result_hits.inc()
            return b'{"cached":true,' + hit[1:]
        self.metrics.result_misses.inc()
        encoded = await self._answer(serving, c, digests)
        await self.cache.set(key, encoded, s.cache_ttl_s)
        # The cached form lacks the `cached` flag: it is spliced in as the first key, so neither
        # a hit nor a miss serialises the results twice.
        return b'{"cached":false,' + encoded[1:]

    async def _answer(
        self, serving: ServingVersion, c: CheckedSearch, digests: dict[str, str] | None
    ) -> bytes:
        """Encode, search and format one query (`digests`: its raw inputs' embedding-cache
        keys; None with no cache)."""
        try:
            async with self.deadline():
                embs = await self._embeddings(serving, c, digests)
                item = SearchItem(embs, c.k, c.filter, c.effort, c.field)
                scores, rows = await serving.searchers[c.view].submit(item)
            return self._format(serving, c, scores, rows)
        except InputError as exc:  # the query factor overflowed
            raise InvalidInput(str(exc)) from None
        except BackendUnavailable as exc:  # Milvus, for a version whose views live there
            raise BackendDown.of(exc) from None

    async def _embeddings(
        self, serving: ServingVersion, c: CheckedSearch, digests: dict[str, str] | None
    ) -> dict[str, np.ndarray]:
        encodes = [
            self._encode(serving, m, c.raw[m], None if digests is None else digests[m])
            for m in c.raw
        ]
        if not encodes:
            return c.given
        # One raw input (the common query) is awaited as it is: gathering wraps it in a task.
        raw = [await encodes[0]] if len(encodes) == 1 else await gather_all(encodes)
        return {**c.given, **dict(zip(c.raw, raw, strict=True))}

    async def _encode(
        self, serving: ServingVersion, modality: str, value: Any, value_digest: str | None
    ) -> np.ndarray:
        """One query embedding, from the cache (keyed by model fingerprint and input) or
        encoded. Encoders that run inline (vectors) are cheaper than a cache round trip; with
        no cache (`value_digest` None) there is none to make."""
        field = f"query.{modality}"
        if value_digest is None or serving.encoders[modality].executor is None:
            return await self.encode_one(serving, modality, value, field)
        key = f"{self.settings.cache_prefix}:emb:{serving.fingerprint}:{modality}:{value_digest}"
        cached = await self.cache.get(key)
        d = serving.model.cfg.latent_dim
        if cached is not None and len(cached) == 4 * d:
            self.metrics.cache.labels(kind="embedding", outcome="hit").inc()
            return np.frombuffer(cached, dtype=np.float32).copy()
        self.metrics.cache.labels(kind="embedding", outcome="miss").inc()
        emb = await self.encode_one(serving, modality, value, field)
        await self.cache.set(key, emb.tobytes(), self.settings.cache_ttl_s)
        return emb

    @staticmethod
    async def encode_one(
        serving: ServingVersion, modality: str, value: Any, field: str
    ) -> np.ndarray:
        """One raw input through its modality's batcher; its own error names `field`."""
        try:
            return await serving.encoders[modality].submit(value)
        except InputError as exc:
            raise as_api_error(field, exc) from None

    @staticmethod
    def _format(
        serving: ServingVersion, c: CheckedSearch, scores: np.ndarray, rows: np.ndarray
    ) -> bytes:
        records = serving.index.records
        # Payloads go into the response as the JSON bytes the record store holds, unparsed.
        results = [
            {
                "id": records.id_at(r),
                "score": sc,
                "payload": orjson.Fragment(records.payload_json(r)),
            }
            for sc, r in zip(scores.tolist(), rows.tolist(), strict=True)
            if r >= 0
        ]
        out: dict[str, object] = {"index_version": serving.version, "view": c.view}
        view = serving.index.views[c.view]
        if not view.spec.exact and view.spec.effort is not None:  # sq8, fp16: no effort
            out["effort"] = c.effort or view.default_effort
        out["results"] = results
        return orjson.dumps(out)

    @contextlib.asynccontextmanager
    async def deadline(self) -> AsyncIterator[None]:
        """A request that runs past the deadline gives up with a 503; work it queued is
        dropped."""
        seconds = self.settings.request_timeout_s
        try:
            async with asyncio.timeout(seconds):
                yield
        except TimeoutError:
            self.metrics.overloaded.labels(reason="deadline").inc()
            raise DeadlineExceeded(
                f"the request took longer than {seconds:g} s (HCLIP_REQUEST_TIMEOUT_S)"
            ) from None

    # -- batch and embed ----------------------------------------------------------------------

    async def search_batch(self, serving: ServingVersion, checked: list[CheckedSearch]) -> bytes:
        """What goes wrong while a checked query runs (undecodable media, a full queue, the
        deadline) is that query's own error, in its place."""

        async def one(c: CheckedSearch) -> bytes:
            try:
                return await self.search(serving, c)
            except ApiError as exc:
                return orjson.dumps({"status": exc.status, **envelope(exc, None)})

        # Started together, the queries meet in the encoders' and the views' batchers.
        parts = await asyncio.gather(*(one(c) for c in checked))
        return b'{"results":[' + b",".join(parts) + b"]}"

    async def embed(self, serving: ServingVersion, c: CheckedEmbed) -> bytes:
        async with self.deadline():
            embs = await gather_all(
                self.encode_one(serving, c.modality, v, f)
                for v, f in zip(c.values, c.fields, strict=True)
            )
        return orjson.dumps(
            {"model_fingerprint": serving.fingerprint, "embeddings": np.stack(embs).tolist()}
        )
