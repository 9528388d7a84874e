"""One place maps exceptions to status codes and the error envelope
{"error", "error_type", "request_id"}.

One status per class of mistake:
- 422 `invalid_input`: a value fails validation (the body's shape or types, an unknown
  modality, a vector of the wrong length, undecodable media, k out of range), and
  `validation_error` for a body that is not JSON or does not fit the schema;
- 400 `unanswerable_query`: a valid query this index cannot answer (it names every modality,
  or no view exists for its modalities);
- 413 `too_large`: a body, a medium, an image's pixels, an audio clip or a text over its limit;
- 401 `unauthorized`, 404 `not_found`, 405 `method_not_allowed`;
- 409 `version_rejected`: an admin reload found a version that cannot be served;
- 503 `not_ready`, `overloaded` (a queue is full) and `deadline_exceeded` (the request ran
  past HCLIP_REQUEST_TIMEOUT_S), with Retry-After;
- 500 `internal_error`: a bug; the request id is in the response and in the log line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.responses import JSONResponse

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    error_type = "bad_request"
    retry_after_s: float | None = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(ApiError):
    status, error_type = 422, "invalid_input"


class Unanswerable(ApiError):
    status, error_type = 400, "unanswerable_query"


class TooLarge(ApiError):
    status, error_type = 413, "too_large"


class NotFound(ApiError):
    status, error_type = 404, "not_found"


class Unauthorized(ApiError):
    status, error_type = 401, "unauthorized"


class NotReady(ApiError):
    status, error_type = 503, "not_ready"
    retry_after_s = 1.0


class Overloaded(ApiError):
    status, error_type = 503, "overloaded"
    retry_after_s = 1.0


class DeadlineExceeded(ApiError):
    status, error_type = 503, "deadline_exceeded"
    retry_after_s = 1.0


class VersionRejected(ApiError):
    status, error_type = 409, "version_rejected"


def request_id(request: Request) -> str | None:
    rid: str | None = request.scope.get("state", {}).get("request_id")
    return rid


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least one."""
    return str(max(1, round(seconds)))


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

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Anything else is caught by RequestContextMiddleware (app/middleware.py), which answers a
    # 500 envelope and closes the connection cleanly instead of letting the server drop it.
