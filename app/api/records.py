"""A record and its precomputed embeddings: GET /v1/records?id=ID and /v1/embeddings?id=ID,
which take any id, and the path forms /v1/records/{id} and /v1/records/{id}/embeddings, which
cannot name an id holding `/` (an HTTP server decodes %2F before it routes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query

from app.api.auth import ReadKey
from app.api.deps import Serving
from app.api.docs import errors
from app.api.http import JSONResponse
from app.api.schemas import RecordEmbeddingsResponse, RecordResponse
from app.core.errors import NotFound
from app.services.versions import ServingVersion

router = APIRouter(dependencies=[ReadKey])
T = TypeVar("T")
AnyId = Annotated[
    str, Query(alias="id", min_length=1, description="the record's id, any string (URL-encoded)")
]


async def _read(serving: ServingVersion, fn: Callable[..., T], *args: Any) -> T:
    """A record store read: in place from memory maps, on a thread where it waits on the
    network (a version whose records live in Milvus), so that the event loop never does."""
    if serving.index.remote:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _row(serving: ServingVersion, record_id: str) -> int:
    row = await _read(serving, serving.index.records.row_of, record_id)
    if row is None:
        raise NotFound(f"no record with id {record_id!r} in version {serving.version}")
    return row


async def _record(serving: ServingVersion, record_id: str) -> JSONResponse:
    row = await _row(serving, record_id)
    rec = await _read(serving, serving.index.records.__getitem__, row)
    return JSONResponse({**rec, "index_version": serving.version})


@router.get(
    "/v1/records",
    response_model=RecordResponse,
    responses=errors(401, 404, 422, 503),
    summary="A record's payload and modalities, for any id",
)
async def record_by_query(record_id: AnyId, serving: Serving) -> JSONResponse:
    return await _record(serving, record_id)


@router.get(
    "/v1/records/{record_id}",
    response_model=RecordResponse,
    responses=errors(401, 404, 503),
    summary="A record's payload and modalities (an id without '/'; else GET /v1/records?id=)",
)
async def record(record_id: str, serving: Serving) -> JSONResponse:
    return await _record(serving, record_id)


@router.get(
    "/v1/embeddings",
    response_model=RecordEmbeddingsResponse,
    responses=errors(401, 404, 422, 503),
    summary="A record's stored per-modality embeddings (to recompute any score), for any id",
)
async def embeddings_by_query(record_id: AnyId, serving: Serving) -> JSONResponse:
    return await _embeddings(serving, record_id)


@router.get(
    "/v1/records/{record_id}/embeddings",
    response_model=RecordEmbeddingsResponse,
    responses=errors(401, 404, 503),
    summary="A record's stored per-modality embeddings (an id without '/'; else "
    "GET /v1/embeddings?id=)",
)
async def record_embeddings(record_id: str, serving: Serving) -> JSONResponse:
    return await _embeddings(serving, record_id)


async def _embeddings(serving: ServingVersion, record_id: str) -> JSONResponse:
    row = await _row(serving, record_id)
    embeddings = await _read(serving, serving.index.embeddings_of, row)
    return JSONResponse(
        {
            "id": record_id,
            "index_version": serving.version,
            "model_fingerprint": serving.fingerprint,
            "embeddings": embeddings,
        }
    )
