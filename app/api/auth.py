"""Optional API keys for reads: `Authorization: Bearer <key>` on /v1/search, /v1/search/batch,
/v1/embed, /v1/records/* and /v1/info when HCLIP_API_KEYS or HCLIP_API_KEYS_FILE names any;
/metrics takes HCLIP_METRICS_KEY when set (else the read keys). /healthz, /readyz, the page and
the API's description stay open; /v1/admin/* has its own token (HCLIP_ADMIN_TOKEN).

A presented key is compared with every configured one in constant time (hmac.compare_digest),
so neither a match nor its position shows in the time taken.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request

from app.core.errors import Unauthorized
from app.core.settings import Settings


class KeyFileError(ValueError):
    """HCLIP_API_KEYS_FILE cannot be read: the service does not start open by mistake."""


def _file_keys(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"HCLIP_API_KEYS_FILE {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


@dataclass(frozen=True)
class Keys:
    read: tuple[bytes, ...]
    metrics: tuple[bytes, ...]

    @staticmethod
    def of(settings: Settings) -> Keys:
        read = [k.strip() for k in (settings.api_keys or "").split(",") if k.strip()]
        if settings.api_keys_file is not None:
            read += _file_keys(settings.api_keys_file)
        metrics = [settings.metrics_key] if settings.metrics_key else read
        return Keys(tuple(k.encode() for k in read), tuple(k.encode() for k in metrics))


def presented(authorization: bytes | str | None) -> bytes | None:
    """The key of an `Authorization: Bearer <key>` header, as bytes (any byte may come)."""
    if authorization is None:
        return None
    raw = (
        authorization
        if isinstance(authorization, bytes)
        else authorization.encode("utf-8", "surrogateescape")
    )
    scheme, _, key = raw.partition(b" ")
    return key.strip() if scheme.lower() == b"bearer" and key.strip() else None


def matches(key: bytes | None, allowed: tuple[bytes, ...]) -> bool:
    """True when no key is configured, or `key` is one of them (every one compared)."""
    if not allowed:
        return True
    found = False
    for k in allowed:
        found |= hmac.compare_digest(key or b"", k)
    return found


def refused(what: str) -> Unauthorized:
    return Unauthorized(f"{what} needs 'Authorization: Bearer <key>' with a key the server knows")


async def read_key(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """A dependency of every read route."""
    if not matches(presented(authorization), request.app.state.keys.read):
        raise refused("this route")


async def metrics_key(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> None:
    if not matches(presented(authorization), request.app.state.keys.metrics):
        raise refused("/metrics")


ReadKey = Depends(read_key)
MetricsKey = Depends(metrics_key)
