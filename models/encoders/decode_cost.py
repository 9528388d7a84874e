"""What decoding a raw medium will cost, read from its header before any decoding: an image's
pixels, the seconds of a clip that its encoder reads. The service sums them over a request
and refuses a request over its budget before any work starts."""

from __future__ import annotations

from typing import Any

from models.config import ModalityConfig
from models.encoders.audio import wav_header
from models.encoders.image import image_pixels
from models.encoders.media import read_bytes
from models.limits import InputError, InputLimits, InputTooLarge

# Headers sit in a file's first bytes (a JPEG's after its metadata segments, which rarely
# reach this far): reading a prefix keeps the check cheap on the event loop.
HEADER_BYTES = 48 * 1024
# Formats whose header may lie past the prefix (JPEG segments, RIFF and TIFF chunks): only for
# these is the whole input read; anything else that shows no header in its prefix has none.
LATE_HEADERS = (b"\xff\xd8", b"RIFF", b"II*\x00", b"MM\x00*")


def _cost(data: bytes, cfg: ModalityConfig, limits: InputLimits) -> float:
    if cfg.raw_form == "image":
        return float(image_pixels(data, limits))
    return min(wav_header(data, limits).seconds, cfg.max_seconds)


def decode_cost(value: Any, cfg: ModalityConfig, limits: InputLimits) -> float:
    """Pixels of an image, or seconds of a clip that its encoder reads (at most max_seconds),
    from a base64 data: URI's header alone; 0 for the other kinds. Raises InputError as the
    decoder would for a header it refuses."""
    if cfg.raw_form not in ("image", "audio") or not isinstance(value, str):
        return 0.0
    head, sep, payload = value.partition(",")
    chars = HEADER_BYTES // 3 * 4  # whole base64 quanta
    if sep and len(payload) > chars:
        prefix = read_bytes(f"{head},{payload[:chars]}", None, cfg.raw_form, limits)
        try:
            return _cost(prefix, cfg, limits)
        except InputTooLarge:
            raise
        except InputError:
            if not prefix.startswith(LATE_HEADERS):
                raise
    return _cost(read_bytes(value, None, cfg.raw_form, limits), cfg, limits)
