"""HTTP plumbing: JSON bodies parsed into their request model in one call, orjson responses, the
one error response, the plain route the search routes are served through, and their answers
given up when the client leaves.

A body is read only after the route's key check (a dependency of the router, or first in
deps.search_inputs for the search routes), then parsed and validated in one call by pydantic's
own JSON parser (`model_validate_json`): its limits are the parser's (nesting depth) and the
schema's (how many modalities, numbers, filter fields, queries), so no second parser scans the
bytes first. A large body is parsed on a thread, so the event loop goes on serving meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response
from starlette.routing import request_response

from app.core.errors import ApiError, envelope, retry_after

OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed on a thread
# nginx's "client closed request": what the metrics count for an answer no one was left to read
CLIENT_LEFT = 499
M = TypeVar("M", bound=BaseModel)


# orjson responses: the default JSON encoder halves FastAPI's throughput on result lists. A
# subclass of Starlette's JSONResponse, so that FastAPI documents each route's response model.
class JSONResponse(StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error_response(exc: ApiError, request_id: str | None, close: bool = False) -> JSONResponse:
    """The response of every error: its envelope, its status, Retry-After where it has one, and
    `Connection: close` where the connection is not worth keeping (a body that stalled, a bug)."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = retry_after(exc.retry_after_s)
    if close:
        headers["Connection"] = "close"
    return JSONResponse(envelope(exc, request_id), status_code=exc.status, headers=headers)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency that reads the body and returns it parsed into `model`; a body that is not
    JSON or breaks the schema is a RequestValidationError (the handlers' 422)."""

    async def parse(request: Request) -> M:
        try:
            raw = await request.body()
        except ClientDisconnect:  # the body-limit middleware has answered already (413, 408)
            raise ApiError("the client left before its body arrived") from None
        try:
            if len(raw) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(model.model_validate_json, raw)
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None

    return parse


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, bytes]) -> Response:
    """`work`'s bytes as a JSON response, unless the client disconnects first: then `work` is
    cancelled where it waits, so a query still queued for a tower or a view is dropped before
    the call that would have taken it (app.services.batching), and the response is a bodiless
    499 that goes nowhere. Called once the request's body has been read: the disconnect is the
    only message left to receive."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()  # lands where the request waits: this task runs only while it does

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        body = await work
    except asyncio.CancelledError:
        if not left:
            raise  # a cancellation from elsewhere (the server stopping) goes on up
        task.uncancel()
        return Response(status_code=CLIENT_LEFT)
    finally:
        watcher.cancel()
    return Response(body, media_type="application/json")


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` for a body read through json_body: the document names the
    model (app.api.openapi adds its schema to the components)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


class PlainRoute(APIRoute):
    """A route that FastAPI documents and Starlette runs. Its endpoint is `async def f(request)
    -> Response` and takes its inputs itself (deps.search_inputs), so FastAPI's handler around
    it (dependency solving, two exit stacks, telemetry hooks) does nothing for it but cost the
    event loop, as the included router's matching did (docs/benchmarks/tower_serving.md). It
    is called as a Starlette endpoint, whose request handling (exception handlers included) is
    the same; the OpenAPI document is FastAPI's, from the declaration. Any other endpoint is
    refused when the route is declared."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        takes = list(inspect.signature(endpoint).parameters)
        if (
            not inspect.iscoroutinefunction(endpoint)
            or takes != [self.dependant.request_param_name]
            or self.dependant.dependencies
        ):
            raise TypeError(
                f"route {path}: a PlainRoute takes `async def f(request: Request) -> Response` "
                f"with no dependencies, not {endpoint.__name__}{inspect.signature(endpoint)}"
            )
        self.app = request_response(endpoint)
