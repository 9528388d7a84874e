"""POST /v1/search, POST /v1/search/batch and POST /v1/embed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import orjson
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.batching import SearchItem
from app.errors import ApiError, InvalidInput, Unanswerable
from app.query import (
    check_embedding,
    check_raw,
    deadline,
    digest,
    encode_one,
    encode_raw,
    input_digest,
    query_modalities,
)
from app.requests import ApiRoute
from app.responses import JSONResponse
from app.routes.docs import errors
from app.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    EmbedRequest,
    EmbedResponse,
    SearchRequest,
    SearchResponse,
)
from app.serving import ServingVersion
from app.state import AppState, Serving, State, state_and_serving
from indexer.filters import FilterError

router = APIRouter(route_class=ApiRoute)

T = TypeVar("T")


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """All results, or the first error once every awaitable has finished (none is left
    running unobserved)."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return cast(list[T], results)


@dataclass(frozen=True)
class Checked:
    """A search request after the checks that need the served version."""

    view: str
    k: int
    filter: dict[str, object] | None
    effort: int | None
    given: dict[str, torch.Tensor]  # the request's embeddings, checked
    decoded: dict[str, Any]  # raw `vector` inputs, decoded by the checks


async def _query_vector(
    state: AppState,
    serving: ServingVersion,
    body: SearchRequest,
    checked: Checked,
    digests: dict[str, str],
) -> np.ndarray:
    s = state.settings
    encodes = [
        encode_raw(
            serving,
            m,
            checked.decoded.get(m, v),
            digests[m],
            state.cache,
            s.cache_prefix,
            s.cache_ttl_s,
            state.metrics,
        )
        for m, v in body.query.items()
    ]
    # One raw input (the common query) is awaited as it is: gathering wraps it in a task.
    raw = [await encodes[0]] if len(encodes) == 1 else await gather_all(encodes)
    embs = {**checked.given, **dict(zip(body.query, raw, strict=True))}
    modalities = tuple(checked.view.split("+"))
    if serving.omega is not None:
        product = embs[modalities[0]].numpy()
        for m in modalities[1:]:
            product = product * embs[m].numpy()
        xq = serving.omega * product  # what HClipHead.query_factor computes, in the same order
    else:
        with torch.inference_mode():  # no autograd bookkeeping: a fifth of a small model's time
            q = serving.model.head.query_factor({m: e[None] for m, e in embs.items()}, modalities)
        xq = q[0].numpy().astype(np.float32)  # (D,)
    if not np.isfinite(xq).all():
        field = "embeddings" if body.embeddings else "query"
        raise InvalidInput(f"{field}: the query's vector is not finite (values too large?)")
    return xq


def _checked(state: AppState, serving: ServingVersion, body: SearchRequest) -> Checked:
    """Everything about a request that can be refused before any work is queued."""
    s = state.settings
    k = s.default_k if body.k is None else body.k
    if k > s.max_k:
        raise InvalidInput(f"k: must be between 1 and {s.max_k} (HCLIP_MAX_K), got {k}")
    modalities = query_modalities(serving, list(body.query), list(body.embeddings))
    view_name = "+".join(modalities)
    view = serving.index.views.get(view_name)
    if view is None:
        views = ", ".join(serving.searchers)
        raise Unanswerable(f"no index for query modalities {view_name!r} (views: {views})")
    limits = s.input_limits()
    decoded = {}
    for m, v in body.query.items():
        value = check_raw(serving, m, v, f"query.{m}", limits)
        if value is not None:
            decoded[m] = value
    d = serving.model.cfg.latent_dim
    given = {
        m: check_embedding(f"embeddings.{m}", v, d, s.max_abs_value)
        for m, v in body.embeddings.items()
    }
    flt = body.filter_dict()
    if flt is not None:
        try:
            serving.index.records.fields.validate(flt)
        except FilterError as exc:
            raise InvalidInput(str(exc)) from None
    if body.effort is not None and body.effort > s.max_effort:
        raise InvalidInput(f"effort: at most {s.max_effort} (HCLIP_MAX_EFFORT), got {body.effort}")
    effort = None if view.spec.exact else body.effort  # exact views have no effort to set
    return Checked(view_name, k, flt, effort, given, decoded)


async def run_search(
    state: AppState, serving: ServingVersion, body: SearchRequest, checked: Checked | None = None
) -> bytes:
    """One search, answered as the response body's bytes (errors raise ApiError)."""
    s = state.settings
    # The result cache is looked up before the request is checked: an entry exists only for a
    # request that was checked when it was cached (same version, same settings), and a key
    # holds everything the answer depends on, so a hit skips the checks and the deadline
    # (replicas that share a Redis are meant to share their settings).
    # Each raw input is hashed once: its digest keys both caches.
    digests = {m: await input_digest(v) for m, v in body.query.items()}
    request = {
        "q": digests,
        "e": body.embeddings,
        "k": body.k,
        "f": body.filter_dict(),
        "x": body.effort,
    }
    key = f"{s.cache_prefix}:res:{serving.version}:{digest(request)}"
    hit = await state.cache.get(key)
    if hit is not None:
        state.metrics.result_hits.inc()
        return b'{"cached":true,' + hit[1:]
    c = checked or _checked(state, serving, body)
    state.metrics.result_misses.inc()
    view_name = c.view
    state.versions.searches_in_flight += 1
    try:
        async with deadline(s.request_timeout_s, state.metrics):
            xq = await _query_vector(state, serving, body, c, digests)
            item = SearchItem(xq, c.k, c.filter, c.effort)
            scores, rows = await serving.searchers[view_name].submit(item)
    finally:
        state.versions.searches_in_flight -= 1
    records = serving.index.records
    # Payloads go into the response as the JSON bytes the record store holds, unparsed.
    results = [
        {"id": records.id_at(r), "score": sc, "payload": orjson.Fragment(records.payload_json(r))}
        for sc, r in zip(scores.tolist(), rows.tolist(), strict=True)
        if r >= 0
    ]
    out: dict[str, object] = {"index_version": serving.version, "view": view_name}
    if not serving.index.views[view_name].spec.exact:
        out["effort"] = c.effort or serving.index.views[view_name].default_effort
    out["results"] = results
    encoded = orjson.dumps(out)
    await state.cache.set(key, encoded, s.cache_ttl_s)
    # The cached form lacks the `cached` flag: it is spliced in as the first key, so neither
    # a hit nor a miss serialises the results twice.
    return b'{"cached":false,' + encoded[1:]


@router.post(
    "/v1/search",
    response_model=SearchResponse,
    responses=errors(400, 413, 422, 503),
    summary="Nearest records for a query of one or more modalities",
)
async def search(body: SearchRequest, request: Request) -> Response:
    state, serving = state_and_serving(request)
    return Response(await run_search(state, serving, body), media_type="application/json")


@router.post(
    "/v1/search/batch",
    response_model=BatchSearchResponse,
    responses=errors(400, 413, 422, 503),
    summary="Several searches in one request, answered in order, each with its own error",
)
async def search_batch(body: BatchSearchRequest, state: State, serving: Serving) -> Response:
    limit = state.settings.max_batch_queries
    if len(body.queries) > limit:
        raise InvalidInput(
            f"queries: at most {limit} (HCLIP_MAX_BATCH_QUERIES), got {len(body.queries)}"
        )
    # A query that fails validation (or that no view can answer) refuses the whole batch, as
    # any body that breaks the schema does; what goes wrong while a valid query runs
    # (undecodable media, a full queue, the deadline) is that query's own error, in its place.
    checked: list[Checked] = []
    for i, q in enumerate(body.queries):
        try:
            checked.append(_checked(state, serving, q))
        except ApiError as exc:
            exc.message = f"queries[{i}].{exc.message}"
            raise

    async def one(q: SearchRequest, c: Checked) -> bytes:
        try:
            return await run_search(state, serving, q, c)
        except ApiError as exc:
            err = {"status": exc.status, "error": exc.message, "error_type": exc.error_type}
            return orjson.dumps(err)

    # Started together, the queries meet in the encoders' and the views' batchers.
    parts = await asyncio.gather(*(one(q, c) for q, c in zip(body.queries, checked, strict=True)))
    return Response(b'{"results":[' + b",".join(parts) + b"]}", media_type="application/json")


@router.post(
    "/v1/embed",
    response_model=EmbedResponse,
    responses=errors(413, 422, 503),
    summary="Embeddings of raw inputs of one modality",
)
async def embed(body: EmbedRequest, state: State, serving: Serving) -> JSONResponse:
    model = serving.model
    if body.modality not in model.names:
        raise InvalidInput(
            f"modality: unknown modality {body.modality!r} (model has: {', '.join(model.names)})"
        )
    limit = state.settings.max_embed_inputs
    if len(body.inputs) > limit:
        raise InvalidInput(
            f"inputs: at most {limit} inputs (HCLIP_MAX_EMBED_INPUTS), got {len(body.inputs)}"
        )
    fields = [f"inputs[{i}]" for i in range(len(body.inputs))]
    limits = state.settings.input_limits()
    for value, field in zip(body.inputs, fields, strict=True):
        check_raw(serving, body.modality, value, field, limits)
    async with deadline(state.settings.request_timeout_s, state.metrics):
        embs = await gather_all(
            encode_one(serving, body.modality, v, f)
            for v, f in zip(body.inputs, fields, strict=True)
        )
    return JSONResponse(
        {"model_fingerprint": serving.fingerprint, "embeddings": np.stack(embs).tolist()}
    )
