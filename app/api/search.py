"""POST /v1/search, POST /v1/search/batch and POST /v1/embed: thin adapters over
app.services.search. Each takes its inputs from deps.search_inputs, which checks the key before
the body is read."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.deps import search_inputs
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

router = APIRouter()
JSON = "application/json"
parse_search = json_body(SearchRequest)
parse_batch = json_body(BatchSearchRequest)
parse_embed = json_body(EmbedRequest)


@router.post(
    "/v1/search",
    response_model=SearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    openapi_extra=body_schema(SearchRequest),
    summary="Nearest records for a query of one or more modalities",
)
async def search(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_search)
    checked = state.checks.search(serving, body)
    return Response(await state.search.search(serving, checked), media_type=JSON)


@router.post(
    "/v1/search/batch",
    response_model=BatchSearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    openapi_extra=body_schema(BatchSearchRequest),
    summary="Several searches in one request, answered in order, each with its own error",
)
async def search_batch(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_batch)
    checked = state.checks.batch(serving, body.queries)
    return Response(await state.search.search_batch(serving, checked), media_type=JSON)


@router.post(
    "/v1/embed",
    response_model=EmbedResponse,
    responses=errors(401, 408, 413, 422, 503),
    openapi_extra=body_schema(EmbedRequest),
    summary="Embeddings of raw inputs of one modality",
)
async def embed(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_embed)
    checked = state.checks.embed(serving, body.modality, body.inputs)
    return Response(await state.search.embed(serving, checked), media_type=JSON)
