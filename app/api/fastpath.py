"""POST /v1/search answered beside the framework, not through it (app.main.App calls this
before any of FastAPI's layers).

Under load most of a search's event-loop time went to the framework around the handler (route
matching, the request and response objects, dependency and body solving, the middleware
layers; docs/benchmarks/serving.md). For the one route
that carries the traffic, this handler does the same work directly: it reads the body (under
the body limit), parses it with the same parser, validates it with the same pydantic model,
runs the same search service, and answers with the same bytes, status, headers, request id, error
envelope and metrics as the routed path.

Anything it does not take as its own goes through the whole application stack unchanged, with
the body replayed where it was read: a body that is not JSON or breaks the schema, another
content type, a body announced over the limit. So every client mistake gets the routed path's
own 422, worded as it always was, and this module never reproduces the framework's validation
messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.auth import matches, presented, refused
from app.api.deps import serving_of
from app.api.http import OFF_LOOP_BYTES, JsonLimits, limits_of, parse_json
from app.api.middleware import (
    body_too_large,
    error_body,
    internal_error_body,
    receive_within,
    request_id_of,
)
from app.api.schemas import SearchRequest
from app.core.errors import ApiError, BodyTimeout, retry_after
from app.core.metrics import Metrics
from app.services.state import AppState

log = logging.getLogger(__name__)

PATH = "/v1/search"
CLOSE = [(b"connection", b"close")]
UNAUTHORIZED = [(b"www-authenticate", b"Bearer")]
JSON_TYPES = (b"application/json", b"application/json; charset=utf-8")


def _validated(body: bytes, limits: JsonLimits) -> SearchRequest:
    return SearchRequest.model_validate(parse_json(body, limits))


def is_fast_path(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"] == PATH and scope["method"] == "POST"


class SearchFastPath:
    def __init__(
        self, routed: ASGIApp, metrics: Metrics, instance: str = "", max_body_bytes: int = 0
    ):
        self.routed = routed  # the whole application stack, for what this does not take
        self.metrics = metrics
        self.instance = (b"x-hclip-instance", instance.encode("latin-1", "replace"))
        self.max_body_bytes = max_body_bytes
        # Label lookups are dictionary work per request: done once for the common outcomes.
        self._latency = metrics.latency.labels(PATH)
        self._ok = metrics.requests.labels(PATH, "POST", "200")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Only for requests is_fast_path(scope) accepts (app.main.App asks first)."""
        start = time.perf_counter()
        content_type = b""
        authorization = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value.lower()
            elif name == b"authorization":
                authorization = value
            elif name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self.routed(scope, receive, send)  # the routed path answers its 413
                return
        hclip: AppState | None = getattr(scope["app"].state, "hclip", None)
        if content_type not in JSON_TYPES or hclip is None:
            await self.routed(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid  # the routed path keeps it, if replayed
        if not matches(presented(authorization), scope["app"].state.keys.read):
            body = error_body(refused("this route"), rid)
            await self._send(scope, send, start, 401, body, UNAUTHORIZED, rid)
            return
        chunks: list[bytes] = []
        size = 0
        receive = receive_within(receive, hclip.settings.body_timeout_s)
        while True:
            try:
                message = await receive()
            except BodyTimeout as exc:
                await self._send(scope, send, start, exc.status, error_body(exc, rid), CLOSE, rid)
                return
            if message["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                too_large = body_too_large(self.max_body_bytes, rid)
                await self._send(scope, send, start, 413, too_large, rid=rid)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        limits = limits_of(hclip.settings)
        try:
            if len(body) > OFF_LOOP_BYTES:  # parsed and validated on a thread
                request = await asyncio.to_thread(_validated, body, limits)
            else:
                request = _validated(body, limits)
        except (json.JSONDecodeError, ValidationError):
            await self._replay(scope, receive, send, body)  # its 422, as the routed path words it
            return
        await self._answer(scope, send, start, hclip, request, rid)

    async def _replay(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        """The routed application, given the body already read."""
        sent = False

        async def replayed() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.routed(scope, replayed, send)

    async def _answer(
        self,
        scope: Scope,
        send: Send,
        start: float,
        hclip: AppState,
        request: SearchRequest,
        rid: str,
    ) -> None:
        extra: list[tuple[bytes, bytes]] = []
        try:
            status, body = 200, await hclip.search.search(await serving_of(hclip), request)
        except ApiError as exc:
            status = exc.status
            body = orjson.dumps(
                {"error": exc.message, "error_type": exc.error_type, "request_id": rid}
            )
            if exc.retry_after_s is not None:
                extra.append((b"retry-after", retry_after(exc.retry_after_s).encode()))
        except Exception:
            log.exception("request %s POST %s failed", rid, PATH)
            status = 500
            body = internal_error_body(rid)
            extra.append((b"connection", b"close"))
        await self._send(scope, send, start, status, body, extra, rid)

    async def _send(
        self,
        scope: Scope,
        send: Send,
        start: float,
        status: int,
        body: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
        rid: str | None = None,
    ) -> None:
        rid = rid or request_id_of(scope)
        headers = [
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
            *(extra or ()),
            (b"x-request-id", rid.encode()),
            self.instance,
        ]
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            counter: Any = (
                self._ok
                if status == 200
                else self.metrics.requests.labels(PATH, "POST", str(status))
            )
            counter.inc()
            self._latency.observe(time.perf_counter() - start)
