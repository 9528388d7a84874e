"""Reading a medium's bytes: a file path relative to the records file, or a base64 data: URI,
with the size limit checked before the expensive part (decoding the base64, reading the file)."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from models.limits import DEFAULT_LIMITS, InputError, InputLimits, InputTooLarge


def read_bytes(value: Any, base_dir: Path | None, what: str, limits: InputLimits) -> bytes:
    """Bytes of a path (relative to base_dir) or of a base64 data: URI."""
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
    elif not isinstance(value, str) or not value:
        raise InputError(
            f"expected a file path or a data: URI for {what}, got {type(value).__name__}"
        )
    elif value.startswith("data:"):
        header, sep, payload = value.partition(",")
        if not sep or ";base64" not in header:
            raise InputError(f"{what} data: URI must be base64 encoded ('data:...;base64,...')")
        if len(payload) * 3 // 4 > limits.max_media_bytes:
            raise InputTooLarge(
                f"{what} is over the limit of {limits.max_media_bytes} bytes (max_media_bytes)"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"{what} data: URI holds invalid base64") from None
    else:
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            size = path.stat().st_size
            if size > limits.max_media_bytes:
                raise InputTooLarge(
                    f"{what} file {path} is {size} bytes, over the limit of "
                    f"{limits.max_media_bytes} (max_media_bytes)"
                )
            data = path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"{what} file not found: {path}") from None
        except OSError as exc:
            raise InputError(f"{what} file unreadable: {path}: {exc.strerror}") from None
    if len(data) > limits.max_media_bytes:
        raise InputTooLarge(
            f"{what} is {len(data)} bytes, over the limit of {limits.max_media_bytes} "
            "(max_media_bytes)"
        )
    return data


def read_media(
    value: Any, base_dir: Path | None, what: str, limits: InputLimits = DEFAULT_LIMITS
) -> bytes:
    """Bytes of a base64 data: URI, or of a file path relative to `base_dir`, for plugins.

    Without a base_dir (a query in the service) a file path is refused: a client must never make
    the server read a file it names. Records files always pass their directory."""
    if isinstance(value, str) and not value.startswith("data:") and base_dir is None:
        raise InputError(f"{what} must be a base64 data: URI here (file paths come from records)")
    return read_bytes(value, base_dir, what, limits)
