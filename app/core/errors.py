"""The service's errors, one class per status and error type, and the one maker of the error
envelope {"error", "error_type", "request_id"} (`envelope`): the routes' exception handlers,
the middlewares' early answers and the batch route's per-query errors all use it.

One status per class of mistake:
- 422 `invalid_input`: a value fails validation (the body's shape or types, an unknown
  modality, a vector of the wrong length, undecodable media, k out of range), and
  `validation_error` for a body that is not JSON or does not fit the schema;
- 400 `unanswerable_query`: a valid query this index cannot answer (it names every modality,
  or no view exists for its modalities);
- 413 `too_large`: a body, a medium, an image's pixels, an audio clip or a text over its limit;
- 401 `unauthorized`, 404 `not_found`, 405 `method_not_allowed`;
- 408 `body_timeout`: the body did not arrive within HCLIP_BODY_TIMEOUT_S (the connection is
  closed);
- 409 `version_rejected`: an admin reload found a version that cannot be served;
- 503 `not_ready`, `overloaded` (a queue is full), `deadline_exceeded` (the request ran
  past HCLIP_REQUEST_TIMEOUT_S) and `backend_unavailable` (Milvus did not answer), with
  Retry-After;
- 500 `internal_error`: a bug; the request id is in the response and in the log line.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    error_type = "bad_request"
    retry_after_s: float | None = None

    def __init__(self, message: str, status: int | None = None, error_type: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:  # an error of the framework's (404, 405), kept as it came
            self.status = status
        if error_type is not None:
            self.error_type = error_type


def envelope(exc: ApiError, request_id: str | None) -> dict[str, Any]:
    """The body of every error response."""
    return {"error": exc.message, "error_type": exc.error_type, "request_id": request_id}


class InvalidInput(ApiError):
    status, error_type = 422, "invalid_input"


class BadBody(ApiError):
    """A body that is not JSON or does not fit the request's schema."""

    status, error_type = 422, "validation_error"


def out_of_range(field: str, value: int, low: int, high: int, setting: str) -> InvalidInput:
    """The one message of every number out of its range: the field, the range, the setting."""
    return InvalidInput(f"{field}: must be between {low} and {high} ({setting}), got {value}")


class Unanswerable(ApiError):
    status, error_type = 400, "unanswerable_query"


class TooLarge(ApiError):
    status, error_type = 413, "too_large"


class NotFound(ApiError):
    status, error_type = 404, "not_found"


class Unauthorized(ApiError):
    status, error_type = 401, "unauthorized"


class BodyTimeout(ApiError):
    status, error_type = 408, "body_timeout"


class NotReady(ApiError):
    status, error_type = 503, "not_ready"
    retry_after_s = 1.0


class Overloaded(ApiError):
    status, error_type = 503, "overloaded"
    retry_after_s = 1.0


class DeadlineExceeded(ApiError):
    status, error_type = 503, "deadline_exceeded"
    retry_after_s = 1.0


class BackendDown(ApiError):
    """The store a version's views live in (Milvus) did not answer: the request is worth
    sending again."""

    status, error_type = 503, "backend_unavailable"
    retry_after_s = 2.0

    @classmethod
    def of(cls, exc: Exception) -> BackendDown:
        """The one place a backend's failure (indexer.store.artifact.BackendUnavailable) becomes
        the service's: the client gets the service's own words (`public`), never the client
        library's text or the backend's address; the detail is logged where the call failed
        (indexer.store.milvus_served)."""
        log.debug("backend unavailable: %s", exc)
        return cls(getattr(exc, "public", None) or "the vector database is unavailable")


class VersionRejected(ApiError):
    status, error_type = 409, "version_rejected"


class InternalError(ApiError):
    """A bug: no detail of it in the answer, only the request id to find it in the log."""

    status, error_type = 500, "internal_error"

    def __init__(self) -> None:
        super().__init__("internal error")


def retry_after(seconds: float) -> str:
    """The Retry-After header's value: whole seconds, at least one."""
    return str(max(1, round(seconds)))
