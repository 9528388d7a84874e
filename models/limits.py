"""What a raw input may cost to decode, and the errors a decoder raises: the leaf that the
config, the plugins API and every encoder's decoder share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)


class InputError(ValueError):
    """A raw input cannot be decoded for its modality."""


class InputTooLarge(InputError):
    """A raw input exceeds a configured limit; the message names the limit."""


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one raw input may cost to decode. The defaults suit offline indexing;
    the service passes its own (HCLIP_MAX_* settings)."""

    max_media_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024
    max_audio_seconds: float = 600.0
    min_sample_rate: int = 1000
    max_sample_rate: int = 384_000
    max_text_chars: int = 100_000
    max_abs_value: float = FLOAT32_MAX  # a number in a vector or an embedding


DEFAULT_LIMITS = InputLimits()
