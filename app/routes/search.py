"""POST /v1/search and POST /v1/embed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar, cast

import numpy as np
import orjson
import torch
from fastapi import APIRouter
from starlette.responses import Response

from app.errors import InvalidInput, Unanswerable
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
from app.schemas import EmbedRequest, EmbedResponse, SearchRequest, SearchResponse
from app.serving import ServingVersion
from app.state import AppState, Serving, State

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


async def _query_vector(
    state: AppState,
    serving: ServingVersion,
    body: SearchRequest,
    modalities: tuple[str, ...],
    digests: dict[str, str],
) -> np.ndarray:
    s = state.settings
    d = serving.model.cfg.latent_dim
    given = {m: check_embedding(f"embeddings.{m}", v, d) for m, v in body.embeddings.items()}
    raw = await gather_all(
        encode_raw(
            serving, m, v, digests[m], state.cache, s.cache_prefix, s.cache_ttl_s, state.metrics
        )
        for m, v in body.query.items()
    )
    embs = {**given, **dict(zip(body.query, raw, strict=True))}
    with torch.no_grad():
        q = serving.model.head.query_factor({m: e[None] for m, e in embs.items()}, modalities)
    return q[0].numpy().astype(np.float32)  # (D,)


@router.post(
    "/v1/search",
    response_model=SearchResponse,
    responses=errors(400, 413, 422, 503),
    summary="Nearest records for a query of one or more modalities",
)
async def search(body: SearchRequest, state: State, serving: Serving) -> Response:
    s = state.settings
    k = s.default_k if body.k is None else body.k
    if k > s.max_k:
        raise InvalidInput(f"k: must be between 1 and {s.max_k} (HCLIP_MAX_K), got {k}")
    modalities = query_modalities(serving, list(body.query), list(body.embeddings))
    view_name = "+".join(modalities)
    searcher = serving.searchers.get(view_name)
    if searcher is None:
        raise Unanswerable(
            f"no index for query modalities {view_name!r} (views: {', '.join(serving.searchers)})"
        )
    for m, v in body.query.items():
        check_raw(serving, m, v, f"query.{m}")
    async with deadline(s.request_timeout_s, state.metrics):
        # Each raw input is hashed once: its digest keys both caches.
        digests = {m: await input_digest(v) for m, v in body.query.items()}
        key = (
            f"{s.cache_prefix}:res:{serving.version}:"
            f"{digest({'q': digests, 'e': body.embeddings, 'k': k})}"
        )
        hit = await state.cache.get(key)
        if hit is not None:
            state.metrics.result_hits.inc()
            return _json_bytes(b'{"cached":true,' + hit[1:])
        state.metrics.result_misses.inc()
        xq = await _query_vector(state, serving, body, modalities, digests)
        scores, rows = await searcher.submit((xq, k))
    records = serving.index.records
    # Payloads go into the response as the JSON bytes the record store holds, unparsed.
    results = [
        {"id": records.id_at(r), "score": sc, "payload": orjson.Fragment(records.payload_json(r))}
        for sc, r in zip(scores.tolist(), rows.tolist(), strict=True)
        if r >= 0
    ]
    encoded = orjson.dumps(
        {"index_version": serving.version, "view": view_name, "results": results}
    )
    await state.cache.set(key, encoded, s.cache_ttl_s)
    return _json_bytes(b'{"cached":false,' + encoded[1:])


def _json_bytes(body: bytes) -> Response:
    """The cached form is the response without its `cached` flag: the flag is spliced in as
    the first key, so neither a hit nor a miss serialises the results twice."""
    return Response(body, media_type="application/json")


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
    for value, field in zip(body.inputs, fields, strict=True):
        check_raw(serving, body.modality, value, field)
    async with deadline(state.settings.request_timeout_s, state.metrics):
        embs = await gather_all(
            encode_one(serving, body.modality, v, f)
            for v, f in zip(body.inputs, fields, strict=True)
        )
    return JSONResponse(
        {"model_fingerprint": serving.fingerprint, "embeddings": np.stack(embs).tolist()}
    )
