"""POST /v1/search, POST /v1/search/batch and POST /v1/embed: thin adapters over
app.services.search. The key is checked (the router's dependency) before the body is read."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import Response

from app.api.auth import ReadKey
from app.api.deps import Serving, State
from app.api.docs import errors
from app.api.http import body_schema, json_body
from app.api.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    EmbedRequest,
    EmbedResponse,
    SearchRequest,
    SearchResponse,
)

router = APIRouter(dependencies=[ReadKey])
JSON = "application/json"


@router.post(
    "/v1/search",
    response_model=SearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    openapi_extra=body_schema(SearchRequest),
    summary="Nearest records for a query of one or more modalities",
)
async def search(
    body: Annotated[SearchRequest, Depends(json_body(SearchRequest))],
    state: State,
    serving: Serving,
) -> Response:
    checked = state.checks.search(serving, body)
    return Response(await state.search.search(serving, checked), media_type=JSON)


@router.post(
    "/v1/search/batch",
    response_model=BatchSearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    openapi_extra=body_schema(BatchSearchRequest),
    summary="Several searches in one request, answered in order, each with its own error",
)
async def search_batch(
    body: Annotated[BatchSearchRequest, Depends(json_body(BatchSearchRequest))],
    state: State,
    serving: Serving,
) -> Response:
    checked = state.checks.batch(serving, body.queries)
    return Response(await state.search.search_batch(serving, checked), media_type=JSON)


@router.post(
    "/v1/embed",
    response_model=EmbedResponse,
    responses=errors(401, 408, 413, 422, 503),
    openapi_extra=body_schema(EmbedRequest),
    summary="Embeddings of raw inputs of one modality",
)
async def embed(
    body: Annotated[EmbedRequest, Depends(json_body(EmbedRequest))],
    state: State,
    serving: Serving,
) -> Response:
    checked = state.checks.embed(serving, body.modality, body.inputs)
    return Response(await state.search.embed(serving, checked), media_type=JSON)
