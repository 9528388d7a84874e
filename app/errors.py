"""One place maps exceptions to status codes and the error envelope {"error", "error_type"}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.responses import JSONResponse

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    error_type = "bad_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(ApiError):
    status, error_type = 400, "invalid_input"


class NotFound(ApiError):
    status, error_type = 404, "not_found"


class Unauthorized(ApiError):
    status, error_type = 401, "unauthorized"


class NotReady(ApiError):
    status, error_type = 503, "not_ready"


class VersionRejected(ApiError):
    status, error_type = 409, "version_rejected"


def envelope(status: int, error_type: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def install(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return envelope(exc.status, exc.error_type, exc.message)

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return envelope(422, "validation_error", _validation_message(exc))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return envelope(exc.status_code, kind, str(exc.detail))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return envelope(500, "internal_error", "internal error")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
