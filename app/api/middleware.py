"""Pure ASGI middlewares (cheaper than BaseHTTPMiddleware): request ids and the last-resort 500,
request metrics, and a body limit."""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.metrics import Metrics

log = logging.getLogger(__name__)

_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")


def request_id_of(scope: Scope) -> str:
    """The client's X-Request-ID when it is a sane token, else a fresh one."""
    for k, v in scope["headers"]:
        if k == b"x-request-id" and _CLIENT_ID.match(v):
            return v.decode()
    return secrets.token_hex(8)


def body_too_large(max_bytes: int) -> bytes:
    """The 413 envelope of a body over HCLIP_MAX_BODY_BYTES."""
    return orjson.dumps(
        {
            "error": f"request body over the limit of {max_bytes} bytes (HCLIP_MAX_BODY_BYTES)",
            "error_type": "too_large",
        }
    )


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


FILE_MOUNTS = ("/static", "/media")  # the page's files and the demo's media (app.api.page)


def endpoint_of_file(path: str) -> str:
    """The label of a request no route matched: a mount it fell under, else `unmatched`."""
    return next((m for m in FILE_MOUNTS if path == m or path.startswith(m + "/")), "unmatched")


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

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # The route template, not the raw path, keeps label cardinality bounded.
            route: Any = scope.get("route")
            endpoint = getattr(route, "path", None) or endpoint_of_file(scope["path"])
            self.metrics.requests.labels(endpoint, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


class BodyLimitMiddleware:
    """413 for bodies over the limit, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
                return
        seen = 0
        rejected = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request" and not rejected:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer 413 now and tell the app the client left, so it stops reading.
                    rejected = True
                    await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not rejected:  # once the 413 is out, whatever the app says goes nowhere
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send: Send) -> None:
        body = body_too_large(self.max_bytes)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
