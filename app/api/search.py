"""POST /v1/search, POST /v1/search/batch and POST /v1/embed: thin adapters over
app.services.search. Each takes its inputs from deps.search_inputs, which checks the key before
the body is read, answers unless its client leaves first (http.unless_client_leaves), and is
served as a http.PlainRoute on the app's own router (install)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from app.api.deps import search_inputs
from app.api.docs import errors
from app.api.http import PlainRoute, body_schema, json_body, unless_client_leaves
from app.api.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    EmbedRequest,
    EmbedResponse,
    SearchRequest,
    SearchResponse,
)

parse_search = json_body(SearchRequest)
parse_batch = json_body(BatchSearchRequest)
parse_embed = json_body(EmbedRequest)


async def search(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_search)
    checked = state.checks.search(serving, body)
    return await unless_client_leaves(request, state.search.search(serving, checked))


async def search_batch(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_batch)
    checked = state.checks.batch(serving, body.queries)
    return await unless_client_leaves(request, state.search.search_batch(serving, checked))


async def embed(request: Request) -> Response:
    body, state, serving = await search_inputs(request, parse_embed)
    checked = state.checks.embed(serving, body.modality, body.inputs)
    return await unless_client_leaves(request, state.search.embed(serving, checked))


def install(app: FastAPI) -> None:
    """The routes, on the app's own router and before any other: FastAPI matches a route of an
    included router twice a request, and the routes it adds itself when the app is made (the
    OpenAPI document, /docs, /redoc) would otherwise each try their pattern before every search."""
    routes = app.router.routes
    before = len(routes)
    declared = app.router.add_api_route
    errors_of_search = errors(400, 401, 408, 413, 422, 503)
    for path, endpoint, body, response, responses, summary in (
        ("/v1/search", search, SearchRequest, SearchResponse, errors_of_search,
         "Nearest records for a query of one or more modalities"),
        ("/v1/search/batch", search_batch, BatchSearchRequest, BatchSearchResponse,
         errors_of_search,
         "Several searches in one request, answered in order, each with its own error"),
        ("/v1/embed", embed, EmbedRequest, EmbedResponse, errors(401, 408, 413, 422, 503),
         "Embeddings of raw inputs of one modality"),
    ):  # fmt: skip
        declared(
            path,
            endpoint,
            methods=["POST"],
            response_model=response,
            responses=responses,
            openapi_extra=body_schema(body),
            summary=summary,
            route_class_override=PlainRoute,
        )
    routes[:] = routes[before:] + routes[:before]
