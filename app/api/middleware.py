"""Pure ASGI middlewares (cheaper than BaseHTTPMiddleware), each a function that wraps an ASGI
app: request ids and the last-resort 500, request metrics, and the body's size and time limits.
Their early answers are app.api.http.error_response's, like every other error."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.http import error_response
from app.core import timing
from app.core.errors import ApiError, BodyTimeout, InternalError, TooLarge
from app.core.metrics import Metrics

log = logging.getLogger(__name__)

_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def request_id_of(scope: Scope) -> str:
    """The request's id: the client's X-Request-ID when it is a sane token, else a fresh one."""
    for k, v in scope["headers"]:
        if k == b"x-request-id" and _CLIENT_ID.match(v):
            return v.decode()
    return secrets.token_hex(8)


def too_large(max_bytes: int) -> TooLarge:
    return TooLarge(f"request body over the limit of {max_bytes} bytes (HCLIP_MAX_BODY_BYTES)")


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


def request_context(app: ASGIApp, instance: str = "", server_timing: bool = True) -> ASGIApp:
    """Gives every request an id (the client's X-Request-ID when it is a sane token) that the
    response and any log line about it carry, and says which instance answered
    (X-Hclip-Instance: behind a load balancer or with several workers, that is the one whose
    logs to read); with `server_timing`, says where the request's time went (Server-Timing:
    app.core.timing); and turns an exception that escaped every handler into a 500 envelope
    with `Connection: close`, so that the client's connection is closed properly instead of
    dropped mid-keep-alive."""
    answered_by = (b"x-hclip-instance", instance.encode("latin-1", "replace"))

    async def with_context(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())
        started = False
        stages, token = timing.begin() if server_timing else (None, None)

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", []), header, answered_by]
                if stages is not None:
                    headers.append((b"server-timing", stages.header()))
                message["headers"] = headers
            await send(message)

        try:
            await app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s %s %s failed", rid, scope["method"], scope["path"])
            if started:
                raise  # headers are out: nothing better to do than let the server close it
            await error_response(InternalError(), rid, close=True)(scope, receive, send_with_id)
        finally:
            if token is not None:
                timing.end(token)

    return with_context


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


def request_metrics(app: ASGIApp, metrics: Metrics) -> ASGIApp:
    """Counts every request by route template, method and status, and times it."""

    async def measured(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
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
            await app(scope, receive, send_wrapper)
        finally:
            # The route template, not the raw path, keeps label cardinality bounded.
            route: Any = scope.get("route")
            endpoint = getattr(route, "path", None) or endpoint_of(asked)
            metrics.requests.labels(endpoint, scope["method"], str(status[0])).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    return measured


def body_limit(app: ASGIApp, max_bytes: int, timeout_s: float) -> ASGIApp:
    """413 for bodies over the limit, whether announced by Content-Length or streamed, and 408
    with `Connection: close` for a body that stops arriving (HCLIP_BODY_TIMEOUT_S): answered
    here, and the app is told the client left, so it stops reading."""

    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = scope.get("state", {}).get("request_id")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
                await error_response(too_large(max_bytes), rid)(scope, receive, send)
                return
        timed = receive_within(receive, timeout_s)
        seen = 0
        answered = False

        async def answer(exc: ApiError, close: bool = False) -> Message:
            nonlocal answered
            answered = True
            await error_response(exc, rid, close)(scope, receive, send)
            return {"type": "http.disconnect"}

        async def limited_receive() -> Message:
            nonlocal seen
            if answered:
                return {"type": "http.disconnect"}
            try:
                message = await timed()
            except BodyTimeout as exc:
                return await answer(exc, close=True)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    return await answer(too_large(max_bytes))
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:  # once the 413 or 408 is out, whatever the app says goes nowhere
                await send(message)

        await app(scope, limited_receive, guarded_send)

    return limited
