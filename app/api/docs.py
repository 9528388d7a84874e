"""The error responses each route documents in the OpenAPI document (see app/core/errors.py)."""

from __future__ import annotations

from typing import Any

from app.api.schemas import ErrorBody

DESCRIPTIONS = {
    400: "A valid query this index cannot answer (it names every modality, or no view exists)",
    401: "Missing or wrong bearer token (an API key where HCLIP_API_KEYS is set)",
    404: "No such record",
    408: "The body did not arrive within HCLIP_BODY_TIMEOUT_S; the connection is closed",
    409: "The version CURRENT names cannot be served; the previous one still is",
    413: "A body, a medium, an image's pixels, a clip or a text over its limit",
    422: "A value fails validation; the message names the field",
    503: "Not ready, overloaded (a full queue) or past the deadline; see Retry-After",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"model": ErrorBody, "description": DESCRIPTIONS[status]}
        if status == 503:
            entry["headers"] = {
                "Retry-After": {
                    "description": "seconds to wait before retrying",
                    "schema": {"type": "integer"},
                }
            }
        out[status] = entry
    return out
