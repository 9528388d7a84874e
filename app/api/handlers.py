"""One place maps exceptions to status codes and the error envelope
{"error", "error_type", "request_id"} (the types: app.core.errors)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.http import JSONResponse
from app.core.errors import ApiError, BackendDown, retry_after
from indexer.store.artifact import BackendUnavailable

log = logging.getLogger(__name__)


def request_id(request: Request) -> str | None:
    rid: str | None = request.scope.get("state", {}).get("request_id")
    return rid


def envelope(
    status: int,
    error_type: str,
    message: str,
    rid: str | None = None,
    retry_after_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    h = dict(headers or {})
    if retry_after_s is not None:
        h["Retry-After"] = retry_after(retry_after_s)
    body = {"error": message, "error_type": error_type, "request_id": rid}
    return JSONResponse(body, status_code=status, headers=h)


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def validation_message(exc: RequestValidationError) -> str:
    """One line per field at fault. A value that fits none of a union's forms (a filter
    condition, a raw input) is named once, not once per form it failed."""
    parts: dict[str, str] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts["body"] = f"not valid JSON ({detail})" if detail else "not valid JSON"
            continue
        loc = tuple(err.get("loc", ()))
        tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and "[" in p), None)
        if tag is not None:
            parts.setdefault(
                _location(loc[:tag]), "fits none of its accepted forms (see /openapi.json)"
            )
        else:
            parts.setdefault(_location(loc), str(err.get("msg", "invalid")))
    return "; ".join(f"{where}: {msg}" for where, msg in list(parts.items())[:5])


def install(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return envelope(
            exc.status, exc.error_type, exc.message, request_id(request), exc.retry_after_s
        )

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return envelope(422, "validation_error", validation_message(exc), request_id(request))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return envelope(
            exc.status_code, kind, str(exc.detail), request_id(request), headers=exc.headers
        )

    async def backend_down(request: Request, exc: Exception) -> JSONResponse:
        down = BackendDown(str(exc))
        return envelope(
            down.status, down.error_type, down.message, request_id(request), down.retry_after_s
        )

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(BackendUnavailable, backend_down)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Anything else is caught by RequestContextMiddleware (app/middleware.py), which answers a
    # 500 envelope and closes the connection cleanly instead of letting the server drop it.
