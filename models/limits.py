"""What a raw input may cost to decode and which files it may read, and the errors a decoder
raises: the leaf that the config, the plugins API and every encoder's decoder share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)


class InputError(ValueError):
    """A raw input cannot be decoded for its modality."""


class InputTooLarge(InputError):
    """A raw input exceeds a configured limit; the message names the limit."""


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one raw input may cost to decode, and on the files it may read. The
    defaults suit offline indexing; the service passes its own (HCLIP_MAX_* settings)."""

    max_media_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024
    max_audio_seconds: float = 600.0
    min_sample_rate: int = 1000
    max_sample_rate: int = 384_000
    max_text_chars: int = 100_000
    max_abs_value: float = FLOAT32_MAX  # a number in a vector or an embedding
    # Where a file path may lead (after `..` and symlinks); None: the directory it is relative
    # to (a records file's folder). Files outside it are refused, whatever the path says.
    media_root: Path | None = None


DEFAULT_LIMITS = InputLimits()


def string_problem(value: str) -> str | None:
    """What makes a string unfit to keep (as an id, a path, a stored or compared value), or
    None: a NUL character, or a lone surrogate (which UTF-8 cannot encode)."""
    if "\x00" in value:
        return "holds a NUL character (\\u0000)"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = ord(value[exc.start])
            return f"holds a lone surrogate (\\u{bad:04x}), which UTF-8 cannot encode"
    return None
