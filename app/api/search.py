"""POST /v1/search, POST /v1/search/batch and POST /v1/embed: thin adapters over
app.services.search."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from app.api.auth import ReadKey
from app.api.deps import Serving, State
from app.api.docs import errors
from app.api.http import ApiRoute
from app.api.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    EmbedRequest,
    EmbedResponse,
    SearchRequest,
    SearchResponse,
)

router = APIRouter(route_class=ApiRoute, dependencies=[ReadKey])
JSON = "application/json"


@router.post(
    "/v1/search",
    response_model=SearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    summary="Nearest records for a query of one or more modalities",
)
async def search(body: SearchRequest, state: State, serving: Serving) -> Response:
    return Response(await state.search.search(serving, body), media_type=JSON)


@router.post(
    "/v1/search/batch",
    response_model=BatchSearchResponse,
    responses=errors(400, 401, 408, 413, 422, 503),
    summary="Several searches in one request, answered in order, each with its own error",
)
async def search_batch(body: BatchSearchRequest, state: State, serving: Serving) -> Response:
    return Response(await state.search.search_batch(serving, body.queries), media_type=JSON)


@router.post(
    "/v1/embed",
    response_model=EmbedResponse,
    responses=errors(401, 408, 413, 422, 503),
    summary="Embeddings of raw inputs of one modality",
)
async def embed(body: EmbedRequest, state: State, serving: Serving) -> Response:
    return Response(await state.search.embed(serving, body.modality, body.inputs), media_type=JSON)
