"""One place maps exceptions to status codes and the error envelope
{"error", "error_type", "request_id"} (the types and the envelope: app.core.errors)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.http import JSONResponse, error_response
from app.core.errors import ApiError, BackendDown, BadBody
from indexer.store.artifact import BackendUnavailable

log = logging.getLogger(__name__)
HTTP_ERRORS = {404: "not_found", 405: "method_not_allowed"}
# How pydantic names the members of a union in an error's location (beside "list[...]" forms).
UNION_TAGS = {"str", "int", "float", "bool", "InCondition", "RangeCondition"}


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in UNION_TAGS)


def request_id(request: Request) -> str | None:
    rid: str | None = request.scope.get("state", {}).get("request_id")
    return rid


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def validation_message(errors: list[Any]) -> str:
    """One line per field at fault. A value that fits none of a union's forms (a filter
    condition, a raw input) is named once, not once per form it failed."""
    parts: dict[str, str] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts["body"] = f"not valid JSON ({detail})" if detail else "not valid JSON"
            continue
        loc = tuple(err.get("loc", ()))
        tag = next((i for i, p in enumerate(loc) if i and _is_union_tag(p)), None)
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
        return error_response(exc, request_id(request))

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(BadBody(validation_message(list(exc.errors()))), request_id(request))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = HTTP_ERRORS.get(exc.status_code, "http_error")
        response = error_response(
            ApiError(str(exc.detail), exc.status_code, kind), request_id(request)
        )
        response.headers.update(exc.headers or {})
        return response

    async def backend_down(request: Request, exc: Exception) -> JSONResponse:
        return error_response(BackendDown.of(exc), request_id(request))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(BackendUnavailable, backend_down)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Anything else is caught by the request-context middleware (app.api.middleware), which
    # answers a 500 envelope and closes the connection cleanly instead of letting the server
    # drop it.
