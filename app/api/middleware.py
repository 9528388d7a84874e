"""Pure ASGI middlewares (cheaper than BaseHTTPMiddleware): request ids and the last-resort 500,
request metrics, and a body limit."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import ApiError, BodyTimeout
from app.core.metrics import Metrics

log = logging.getLogger(__name__)

_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def request_id_of(scope: Scope) -> str:
    """The request's id: the one given it already (the fast path hands a request on with its
    id), else the client's X-Request-ID when it is a sane token, else a fresh one."""
    given: str | None = scope.get("state", {}).get("request_id")
    if given:
        return given
    for k, v in scope["headers"]:
        if k == b"x-request-id" and _CLIENT_ID.match(v):
            return v.decode()
    return secrets.token_hex(8)


def body_too_large(max_bytes: int, rid: str | None) -> bytes:
    """The 413 envelope of a body over HCLIP_MAX_BODY_BYTES."""
    return orjson.dumps(
        {
            "error": f"request body over the limit of {max_bytes} bytes (HCLIP_MAX_BODY_BYTES)",
            "error_type": "too_large",
            "request_id": rid,
        }
    )


def receive_within(receive: Receive, timeout_s: float) -> Receive:
    """`receive`, raising BodyTimeout when the request's body has not all arrived within
    `timeout_s` of this call (what follows the body, a disconnect, is waited for as long as
    it takes)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    done = False

    async def bounded() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):  # a timer, not a task as wait_for makes
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(
                f"the request body did not arrive within {timeout_s:g} s (HCLIP_BODY_TIMEOUT_S)"
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    return bounded


def internal_error_body(rid: str) -> bytes:
    """The 500 envelope: no detail of the bug, only the request id to find it in the log."""
    return orjson.dumps(
        {"error": "internal error", "error_type": "internal_error", "request_id": rid}
    )


class RequestContextMiddleware:
    """Gives every request an id (the client's X-Request-ID when it is a sane token) that the
    response and any log line about it carry, and says which instance answered
    (X-Hclip-Instance: behind a load balancer or with several workers, that is the one whose
    logs to read); and turns an exception that escaped every handler into a 500 envelope with
    `Connection: close`, so that the client's connection is closed properly instead of dropped
    mid-keep-alive."""

    def __init__(self, app: ASGIApp, instance: str = ""):
        self.app = app
        self.instance = (b"x-hclip-instance", instance.encode("latin-1", "replace"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), header, self.instance]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s %s %s failed", rid, scope["method"], scope["path"])
            if started:
                raise  # headers are out: nothing better to do than let the server close it
            body = internal_error_body(rid)
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                        header,
                        self.instance,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})


def endpoint_of(scope: Scope) -> str:
    """The route template (or mount: the page's files, media) a request falls under, for a
    request answered before routing (an early 413, say); `unmatched` when there is none."""
    router = getattr(scope.get("app"), "router", None)
    for route in _flat(getattr(router, "routes", ())):
        path = getattr(route, "path", None)
        if path is not None and route.matches(scope)[0] != Match.NONE:
            return str(path)
    return "unmatched"


def _flat(routes: Iterable[Any]) -> Iterator[Any]:
    """Routes, with those of included routers in their place (FastAPI keeps an included
    router whole from 0.165 on, and flattened it before)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _flat(included.routes)
        else:
            yield route


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]
        # Routing rewrites the scope's paths (a mount): what the request came as, for endpoint_of
        asked = {k: scope[k] for k in ("type", "path", "root_path", "method", "app") if k in scope}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # The route template, not the raw path, keeps label cardinality bounded.
            route: Any = scope.get("route")
            endpoint = getattr(route, "path", None) or endpoint_of(asked)
            self.metrics.requests.labels(endpoint, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether announced by Content-Length or streamed, and 408
    with `Connection: close` for a body that stops arriving (HCLIP_BODY_TIMEOUT_S): answered
    here, and the app is told the client left, so it stops reading."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope.get("state", {}).get("request_id")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _answer(send, 413, body_too_large(self.max_bytes, rid))
                return
        receive = receive_within(receive, self.timeout_s)
        seen = 0
        answered = False

        async def limited_receive() -> Message:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            try:
                message = await receive()
            except BodyTimeout as exc:
                answered = True
                await _answer(send, exc.status, error_body(exc, rid), close=True)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    answered = True
                    await _answer(send, 413, body_too_large(self.max_bytes, rid))
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:  # once the 413 or 408 is out, whatever the app says goes nowhere
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


def error_body(exc: ApiError, rid: str | None) -> bytes:
    return orjson.dumps({"error": exc.message, "error_type": exc.error_type, "request_id": rid})


async def _answer(send: Send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
