"""The one search path: check -> cache -> encode -> query factor -> search -> format.

Every transport calls SearchService: the routed POST /v1/search, the fast path in front of
FastAPI (app.api.fastpath), each query of POST /v1/search/batch. It takes a request that fits
the schema (app.api.schemas.SearchRequest) and returns the response body's bytes, or raises
ApiError.

- check: everything that depends on the served version, in one place: k and effort in range,
  which view the named modalities select, each raw input's type (and, for the cheap kinds,
  its value), each given embedding, the filter against the version's declared fields;
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
import math
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import orjson

from app.core.errors import (
    ApiError,
    BackendDown,
    DeadlineExceeded,
    InvalidInput,
    TooLarge,
    Unanswerable,
    out_of_range,
)
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.services.batching import SearchItem
from app.services.cache import Cache
from app.services.idle_cores import SearchLoad
from app.services.versions import ServingVersion
from indexer.store.artifact import BackendUnavailable
from indexer.store.fields import FilterError
from models.encoders import decode
from models.limits import FLOAT32_MAX, InputError, InputLimits, InputTooLarge

OFF_LOOP_BYTES = 1 << 16  # hashlib releases the GIL on large inputs: hash those on a thread
T = TypeVar("T")


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def digest(obj: Any) -> str:
    """A hash of the canonical JSON form: key order and whitespace do not matter."""
    return _sha(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS))


async def input_digest(value: Any) -> str:
    """The hash of one raw input: the embedding cache's key and a part of the result cache's.
    A megabyte of base64 takes a millisecond to hash; the event loop does not wait for it."""
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else orjson.dumps(value)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_sha, raw)
    return _sha(raw)


def as_api_error(field: str, exc: InputError) -> ApiError:
    cls = TooLarge if isinstance(exc, InputTooLarge) else InvalidInput
    return cls(f"{field}: {exc}")


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """All results, or the first error once every awaitable has finished (none is left
    running unobserved)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return cast(list[T], results)


class SearchRequest(Protocol):
    """What a search names (app.api.schemas.SearchRequest, once it fits the schema)."""

    query: dict[str, Any]
    embeddings: dict[str, list[float]]
    k: int | None
    effort: int | None

    def filter_dict(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class Checked:
    """A search request after its checks: what it asks, resolved against the served version."""

    view: str
    k: int
    filter: dict[str, Any] | None
    effort: int | None  # None for exact views, which have none to set
    raw: dict[str, Any]  # modality -> raw input (a `vector` one already decoded)
    given: dict[str, np.ndarray]  # modality -> the request's embedding, checked
    field: str  # where the query's values came from: named if its factor is not finite


class SearchService:
    def __init__(self, settings: Settings, metrics: Metrics, cache: Cache, load: SearchLoad):
        self.settings = settings
        self.metrics = metrics
        self.cache = cache
        self.load = load  # searches in flight on this machine (app.services.idle_cores)
        self.limits: InputLimits = settings.input_limits()

    # -- check --------------------------------------------------------------------------------

    def check_numbers(self, body: SearchRequest) -> int:
        """The request's integers, before anything uses them (the cache key among others);
        returns k."""
        s = self.settings
        k = s.default_k if body.k is None else body.k
        if not 1 <= k <= s.max_k:
            raise out_of_range("k", k, 1, s.max_k, "HCLIP_MAX_K")
        if body.effort is not None and not 1 <= body.effort <= s.max_effort:
            raise out_of_range("effort", body.effort, 1, s.max_effort, "HCLIP_MAX_EFFORT")
        return k

    def check(self, serving: ServingVersion, body: SearchRequest) -> Checked:
        """Everything about a request that can be refused before any work is queued."""
        k = self.check_numbers(body)
        view_name = "+".join(self._modalities(serving, list(body.query), list(body.embeddings)))
        view = serving.index.views.get(view_name)
        if view is None:
            views = ", ".join(serving.searchers)
            raise Unanswerable(f"no index for query modalities {view_name!r} (views: {views})")
        raw = {m: self._raw(serving, m, v, f"query.{m}") for m, v in body.query.items()}
        d = serving.model.cfg.latent_dim
        given = {m: self._embedding(f"embeddings.{m}", v, d) for m, v in body.embeddings.items()}
        flt = body.filter_dict()
        if flt is not None:
            try:
                serving.index.records.fields.validate(flt)
            except FilterError as exc:
                raise InvalidInput(str(exc)) from None
        effort = None if view.spec.exact else body.effort
        field = "embeddings" if body.embeddings else "query"
        return Checked(view_name, k, flt, effort, raw, given, field)

    @staticmethod
    def _modalities(
        serving: ServingVersion, raw: Sequence[str], given: Sequence[str]
    ) -> tuple[str, ...]:
        names = serving.model.names
        both = sorted(set(raw) & set(given))
        if both:
            raise InvalidInput(f"query.{both[0]}: given both raw and as an embedding")
        modalities = tuple(sorted(set(raw) | set(given)))
        for m in modalities:
            if m not in names:
                field = "query" if m in raw else "embeddings"
                raise InvalidInput(
                    f"{field}.{m}: unknown modality {m!r} (model has: {', '.join(names)})"
                )
        if not modalities:
            raise InvalidInput("query: names no modality: give 'query' or 'embeddings'")
        if len(modalities) == len(names):
            raise Unanswerable("the query names every modality: nothing is left to retrieve")
        return modalities

    def _raw(self, serving: ServingVersion, modality: str, value: Any, field: str) -> Any:
        """A raw input's type, and for the cheap kinds (texts, vectors) its value; media are
        decoded by their encoder's thread. A `vector` input is returned decoded (its encoder
        runs inline and takes it as it is), any other as it came."""
        cfg = serving.model.cfg.modalities[modality]
        # A client must not make the server read its own files: media come inline only.
        if cfg.raw_form in ("image", "audio"):
            if not (isinstance(value, str) and value.startswith("data:")):
                raise InvalidInput(f"{field}: {cfg.raw_form} must be a base64 data: URI")
        elif cfg.raw_form in ("text", "vector", "embedding"):
            try:
                decoded = decode(value, cfg, base_dir=None, limits=self.limits)
            except InputError as exc:
                raise as_api_error(field, exc) from None
            return decoded if cfg.kind == "vector" else value
        return value

    def _embedding(self, field: str, value: list[float], d: int) -> np.ndarray:
        if len(value) != d:
            raise InvalidInput(
                f"{field}: expected {d} numbers (the model's latent d), got {len(value)}"
            )
        if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in value):
            raise InvalidInput(f"{field}: holds NaN, infinite or out-of-float32-range values")
        bound = self.settings.max_abs_value
        if any(abs(v) > bound for v in value):
            raise InvalidInput(f"{field}: holds a number beyond +-{bound:g} (HCLIP_MAX_ABS_VALUE)")
        return np.asarray(value, dtype=np.float32)

    # -- search -------------------------------------------------------------------------------

    async def search(
        self, serving: ServingVersion, body: SearchRequest, checked: Checked | None = None
    ) -> bytes:
        """One search, answered as the response body's bytes (errors raise ApiError).

        The result cache is looked up once the integers are checked, before the rest: an entry
        exists only for a request that passed every check when it was cached (same version,
        same settings), and its key holds everything the answer depends on, so a hit needs
        no more (replicas that share a Redis are meant to share their settings)."""
        s = self.settings
        k = checked.k if checked is not None else self.check_numbers(body)
        # Each raw input is hashed once: its digest keys both caches.
        digests = {m: await input_digest(v) for m, v in body.query.items()}
        request = {"q": digests, "e": body.embeddings, "k": k, "f": body.filter_dict(),
                   "x": body.effort}  # fmt: skip
        key = f"{s.cache_prefix}:res:{serving.version}:{digest(request)}"
        hit = await self.cache.get(key)
        if hit is not None:
            self.metrics.result_hits.inc()
            return b'{"cached":true,' + hit[1:]
        c = checked or self.check(serving, body)
        self.metrics.result_misses.inc()
        self.load.begin()
        try:
            async with self.deadline():
                embs = await self._embeddings(serving, body, c, digests)
                item = SearchItem(embs, c.k, c.filter, c.effort, c.field)
                scores, rows = await serving.searchers[c.view].submit(item)
            encoded = self._format(serving, c, scores, rows)
        except InputError as exc:  # the query factor overflowed
            raise InvalidInput(str(exc)) from None
        except BackendUnavailable as exc:  # Milvus, for a version whose views live there
            raise BackendDown(str(exc)) from None
        finally:
            self.load.end()
        await self.cache.set(key, encoded, s.cache_ttl_s)
        # The cached form lacks the `cached` flag: it is spliced in as the first key, so neither
        # a hit nor a miss serialises the results twice.
        return b'{"cached":false,' + encoded[1:]

    async def _embeddings(
        self, serving: ServingVersion, body: SearchRequest, c: Checked, digests: dict[str, str]
    ) -> dict[str, np.ndarray]:
        encodes = [self._encode(serving, m, c.raw[m], digests[m]) for m in body.query]
        # One raw input (the common query) is awaited as it is: gathering wraps it in a task.
        raw = [await encodes[0]] if len(encodes) == 1 else await gather_all(encodes)
        return {**c.given, **dict(zip(body.query, raw, strict=True))}

    async def _encode(
        self, serving: ServingVersion, modality: str, value: Any, value_digest: str
    ) -> np.ndarray:
        """One query embedding, from the cache (keyed by model fingerprint and input) or
        encoded. Encoders that run inline (vectors) are cheaper than a cache round trip."""
        field = f"query.{modality}"
        if serving.encoders[modality].executor is None:
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
    def _format(serving: ServingVersion, c: Checked, scores: np.ndarray, rows: np.ndarray) -> bytes:
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
        if not view.spec.exact:
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

    async def search_batch(
        self, serving: ServingVersion, queries: Sequence[SearchRequest]
    ) -> bytes:
        """Validated as a whole: a query that fails its checks refuses the batch, naming
        `queries[i]`; what goes wrong while a valid query runs (undecodable media, a full
        queue, the deadline) is that query's own error, in its place."""
        limit = self.settings.max_batch_queries
        if len(queries) > limit:
            raise out_of_range("queries", len(queries), 1, limit, "HCLIP_MAX_BATCH_QUERIES")
        checked: list[Checked] = []
        for i, q in enumerate(queries):
            try:
                checked.append(self.check(serving, q))
            except ApiError as exc:
                exc.message = f"queries[{i}].{exc.message}"
                raise

        async def one(q: SearchRequest, c: Checked) -> bytes:
            try:
                return await self.search(serving, q, c)
            except ApiError as exc:
                err = {"status": exc.status, "error": exc.message, "error_type": exc.error_type}
                return orjson.dumps(err)

        # Started together, the queries meet in the encoders' and the views' batchers.
        parts = await asyncio.gather(*(one(q, c) for q, c in zip(queries, checked, strict=True)))
        return b'{"results":[' + b",".join(parts) + b"]}"

    async def embed(self, serving: ServingVersion, modality: str, inputs: list[Any]) -> bytes:
        model = serving.model
        if modality not in model.names:
            raise InvalidInput(
                f"modality: unknown modality {modality!r} (model has: {', '.join(model.names)})"
            )
        limit = self.settings.max_embed_inputs
        if len(inputs) > limit:
            raise out_of_range("inputs", len(inputs), 1, limit, "HCLIP_MAX_EMBED_INPUTS")
        fields = [f"inputs[{i}]" for i in range(len(inputs))]
        values = [self._raw(serving, modality, v, f) for v, f in zip(inputs, fields, strict=True)]
        async with self.deadline():
            embs = await gather_all(
                self.encode_one(serving, modality, v, f)
                for v, f in zip(values, fields, strict=True)
            )
        return orjson.dumps(
            {"model_fingerprint": serving.fingerprint, "embeddings": np.stack(embs).tolist()}
        )
