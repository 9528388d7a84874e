"""POST /v1/search and POST /v1/embed."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import torch
from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.errors import InvalidInput
from app.query import check_embedding, digest, encode_batch_blocking, encode_raw
from app.responses import JSONResponse
from app.serving import ServingVersion
from app.state import AppState, Serving, State

router = APIRouter()


class SearchBody(BaseModel):
    query: dict[str, Any] = Field(default_factory=dict, description="modality -> raw input")
    embeddings: dict[str, Any] = Field(default_factory=dict, description="modality -> [floats]")
    k: int | None = Field(None, description="results wanted (default HCLIP_DEFAULT_K)")


class EmbedBody(BaseModel):
    modality: str
    inputs: list[Any]


def _modalities(body: SearchBody, serving: ServingVersion) -> tuple[str, ...]:
    names = serving.model.names
    both = sorted(set(body.query) & set(body.embeddings))
    if both:
        raise InvalidInput(f"modality {both[0]!r} is given both raw and as an embedding")
    given = tuple(sorted(set(body.query) | set(body.embeddings)))
    unknown = [m for m in given if m not in names]
    if unknown:
        raise InvalidInput(f"unknown modality {unknown[0]!r} (model has: {', '.join(names)})")
    if not given:
        raise InvalidInput("the query names no modality: give 'query' or 'embeddings'")
    if len(given) == len(names):
        raise InvalidInput("the query names every modality: nothing is left to retrieve")
    return given


async def _query_vector(
    state: AppState, serving: ServingVersion, body: SearchBody, modalities: tuple[str, ...]
) -> np.ndarray:
    s = state.settings
    d = serving.model.cfg.latent_dim
    given = {m: check_embedding(m, v, d) for m, v in body.embeddings.items()}
    raw = await asyncio.gather(
        *(
            encode_raw(
                serving,
                m,
                v,
                state.cache,
                s.cache_prefix,
                s.cache_ttl_s,
                state.metrics,
            )
            for m, v in body.query.items()
        )
    )
    embs = {**given, **dict(zip(body.query, raw, strict=True))}
    with torch.no_grad():
        q = serving.model.head.query_factor({m: e[None] for m, e in embs.items()}, modalities)
    return q[0].numpy().astype(np.float32)  # (D,)


@router.post("/v1/search")
async def search(body: SearchBody, state: State, serving: Serving) -> JSONResponse:
    s = state.settings
    k = s.default_k if body.k is None else body.k
    if not 1 <= k <= s.max_k:
        raise InvalidInput(f"k: must be between 1 and {s.max_k}, got {k}")
    modalities = _modalities(body, serving)
    view_name = "+".join(modalities)
    searcher = serving.searchers.get(view_name)
    if searcher is None:
        raise InvalidInput(
            f"no index for query modalities {view_name!r} (views: {', '.join(serving.searchers)})"
        )
    key = (
        f"{s.cache_prefix}:res:{serving.version}:"
        f"{digest({'q': body.query, 'e': body.embeddings, 'k': k})}"
    )
    hit = await state.cache.get(key)
    if hit is not None:
        state.metrics.cache.labels(kind="result", outcome="hit").inc()
        return JSONResponse({**orjson.loads(hit), "cached": True})
    state.metrics.cache.labels(kind="result", outcome="miss").inc()
    xq = await _query_vector(state, serving, body, modalities)
    scores, rows = await searcher.submit((xq, k))
    records = serving.index.records
    # Payloads go into the response as the JSON bytes the record store holds, unparsed.
    results = [
        {"id": records.id_at(r), "score": sc, "payload": orjson.Fragment(records.payload_json(r))}
        for sc, r in zip(scores.tolist(), rows.tolist(), strict=True)
        if r >= 0
    ]
    out = {"index_version": serving.version, "view": view_name, "results": results}
    await state.cache.set(key, orjson.dumps(out), s.cache_ttl_s)
    return JSONResponse({**out, "cached": False})


@router.post("/v1/embed")
async def embed(body: EmbedBody, state: State, serving: Serving) -> JSONResponse:
    model = serving.model
    if body.modality not in model.names:
        raise InvalidInput(
            f"modality: unknown modality {body.modality!r} (model has: {', '.join(model.names)})"
        )
    if not 1 <= len(body.inputs) <= state.settings.max_embed_inputs:
        raise InvalidInput(f"inputs: give 1 to {state.settings.max_embed_inputs} inputs")
    loop = asyncio.get_running_loop()
    embs = await loop.run_in_executor(
        state.encode_executor, encode_batch_blocking, model, body.modality, body.inputs
    )
    return JSONResponse({"model_fingerprint": serving.fingerprint, "embeddings": embs.tolist()})
