"""Optional API keys for reads: `Authorization: Bearer <key>` on /v1/search, /v1/search/batch,
/v1/embed, /v1/records/*, /v1/info and the demo's /v1/demo/examples and /media/* when
HCLIP_API_KEYS or HCLIP_API_KEYS_FILE names any;
/metrics takes HCLIP_METRICS_KEY when set (else the read keys). /healthz, /readyz, the page and
the API's description stay open; /v1/admin/* has its own token (HCLIP_ADMIN_TOKEN).

A presented key is compared with every configured one in constant time (hmac.compare_digest),
so neither a match nor its position shows in the time taken. Every route reads the header the
same way (`presented`): one `Authorization: Bearer <key>` header, or none; two headers, another
scheme or an empty key present no key at all.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, Request

from app.core.errors import Unauthorized
from app.core.settings import Settings


class KeyFileError(ValueError):
    """The keys asked for cannot be had (a file that cannot be read, settings that name no
    key): the service does not start open by mistake."""


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
        if settings.api_keys and not read:
            raise KeyFileError(
                f"HCLIP_API_KEYS={settings.api_keys!r} names no key: set keys, or leave it unset "
                "for open read routes"
            )
        if settings.api_keys_file is not None:
            from_file = _file_keys(settings.api_keys_file)
            if not from_file:
                raise KeyFileError(
                    f"HCLIP_API_KEYS_FILE {settings.api_keys_file} holds no key (one a line; "
                    "# starts a comment)"
                )
            read += from_file
        metrics = [settings.metrics_key] if settings.metrics_key else read
        return Keys(tuple(k.encode() for k in read), tuple(k.encode() for k in metrics))


def presented(request: Request) -> bytes | None:
    """The key of the request's one `Authorization: Bearer <key>` header, as bytes (any byte
    may come); None for no header, several, another scheme or an empty key."""
    values = [v for k, v in request.scope["headers"] if k == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, key = values[0].partition(b" ")
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


async def read_key(request: Request) -> None:
    """A dependency of every read route, solved before the route's body is read."""
    if not matches(presented(request), request.app.state.keys.read):
        raise refused("this route")


async def metrics_key(request: Request) -> None:
    if not matches(presented(request), request.app.state.keys.metrics):
        raise refused("/metrics")


def admin_token_matches(request: Request, token: str | None) -> bool:
    """The admin routes' check: HCLIP_ADMIN_TOKEN set, and presented as the one bearer key."""
    key = presented(request)
    return bool(token) and key is not None and hmac.compare_digest(key, (token or "").encode())


ReadKey = Depends(read_key)
MetricsKey = Depends(metrics_key)
