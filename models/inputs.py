"""Decoding raw inputs (docs/design.md §3) into the tensors the encoders take.

Raw inputs are what records and queries carry: a string for `text`, a file path or a base64
`data:` URI for `image` and `audio`, a list of floats for `vector` and `embedding`, and whatever
a plugin's own `decode` takes for `plugin`. Every failure raises
InputError with a message that says what is wrong with the value; callers add the record or
field it came from. An input over a size limit of `InputLimits` (bytes, pixels, seconds,
sample rate) raises InputTooLarge; a value over a limit a schema can state (a text's length, a
number's magnitude) is an InputError that names its limit. Each limit
is checked before the expensive part: media bytes before base64 decoding, image pixels from the
header before decompression, audio duration and sample rate from the WAV header before any
sample is read. Decoders of untrusted bytes may fail in ways their libraries do not document,
so anything they raise becomes an InputError for that one value.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig

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


def _read_bytes(value: Any, base_dir: Path | None, what: str, limits: InputLimits) -> bytes:
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
    return _read_bytes(value, base_dir, what, limits)


def decode_vector(
    value: Any, cfg: ModalityConfig, what: str = "vector", limits: InputLimits | None = None
) -> torch.Tensor:
    if not isinstance(value, list | tuple | np.ndarray):
        raise InputError(f"{what} must be a list of numbers, got {type(value).__name__}")
    # A JSON true is not the number 1: numpy would take it as one silently.
    if any(isinstance(v, bool | np.bool_) for v in value):
        raise InputError(f"{what} must be a list of numbers, got a boolean")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except OverflowError:
        raise InputError(f"{what} holds a number too large for float32") from None
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a list of numbers") from None
    if arr.ndim != 1 or arr.shape[0] != cfg.dim:
        got = arr.shape[0] if arr.ndim == 1 else f"shape {arr.shape}"
        raise InputError(f"{what} must have length {cfg.dim}, got {got}")
    if not np.isfinite(arr).all():
        raise InputError(f"{what} holds NaN or infinite values")
    if arr.size and float(np.abs(arr).max()) > FLOAT32_MAX:
        raise InputError(f"{what} holds a number too large for float32 (|x| > 3.4e38)")
    bound = (limits or DEFAULT_LIMITS).max_abs_value
    if arr.size and float(np.abs(arr).max()) > bound:
        raise InputError(f"{what} holds a number beyond +-{bound:g} (max_abs_value)")
    return torch.from_numpy(arr.astype(np.float32))  # (dim,)


def decode_embedding(
    value: Any, cfg: ModalityConfig, limits: InputLimits | None = None
) -> torch.Tensor:
    """A vector from the user's own tower; the encoder L2-normalises it, so it needs a direction."""
    x = decode_vector(value, cfg, "embedding", limits)
    if not bool(x.any()):
        raise InputError("embedding is all zeros: it has no direction to normalise")
    return x  # (dim,)


def decode_plugin(
    value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits
) -> Any:
    from models.plugins import PluginError, plugin

    assert cfg.plugin is not None
    try:
        found = plugin(cfg.plugin)
    except PluginError as exc:
        raise InputError(str(exc)) from None
    try:
        return found.decode(value, cfg.options, base_dir, limits)
    except InputError:
        raise
    except Exception as exc:  # someone else's decoder on untrusted input: one bad value
        raise InputError(
            f"plugin {cfg.plugin!r} could not decode the value ({type(exc).__name__}: {exc})"
        ) from None


def decode_text(value: Any, limits: InputLimits = DEFAULT_LIMITS) -> str:
    if not isinstance(value, str):
        raise InputError(f"text must be a string, got {type(value).__name__}")
    if len(value) > limits.max_text_chars:
        raise InputError(
            f"text is {len(value)} characters, over the limit of {limits.max_text_chars} "
            "(max_text_chars)"
        )
    if not value.strip():
        raise InputError("text is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"text is not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None
    return value


def decode_image(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    from PIL import Image

    data = _read_bytes(value, base_dir, "image", limits)
    try:
        with Image.open(io.BytesIO(data)) as opened:
            w, h = opened.size  # from the header: nothing is decompressed yet
            if w * h > limits.max_image_pixels:
                raise InputTooLarge(
                    f"image is {w}x{h} = {w * h} pixels, over the limit of "
                    f"{limits.max_image_pixels} (max_image_pixels)"
                )
            img = opened.convert("L" if cfg.channels == 1 else "RGB")
            img = img.resize((cfg.image_size, cfg.image_size), Image.Resampling.BILINEAR)
            arr = np.asarray(img, dtype=np.float32) / 255.0
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        # PIL's own guard fires in open() for the largest headers, before ours can look.
        raise InputTooLarge(
            f"image is over the limit of {limits.max_image_pixels} pixels (max_image_pixels): {exc}"
        ) from None
    except Exception:  # PIL's decoders raise many undocumented types on hostile bytes
        raise InputError(
            "image could not be decoded (not a PNG, JPEG or other known format)"
        ) from None
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)  # (C, H, W)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _pcm_to_float(frames: bytes, width: int, channels: int) -> np.ndarray:
    """Whole frames only: a file cut mid-sample or mid-frame loses its partial last frame."""
    frame_bytes = width * channels
    frames = frames[: len(frames) - len(frames) % frame_bytes]
    if width == 1:
        x = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        ints = raw[:, 0].astype(np.int32) | (raw[:, 1].astype(np.int32) << 8)
        ints |= raw[:, 2].astype(np.int32) << 16
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        x = ints.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(frames, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise InputError(f"audio sample width of {width} bytes is not supported")
    return x.reshape(-1, channels).mean(axis=1)


def _read_wav(data: bytes, cfg: ModalityConfig, limits: InputLimits) -> tuple[np.ndarray, int, int]:
    """(mono samples of a prefix, frames in the whole file, rate): only the frames that the
    encoder's max_seconds needs are read, however long the file says it is."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            nframes = w.getnframes()
            if channels <= 0 or channels > 64:
                raise InputError(f"audio WAV header is invalid ({channels} channels)")
            if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
                raise InputTooLarge(
                    f"audio sample rate {rate} Hz is outside the accepted range "
                    f"{limits.min_sample_rate}-{limits.max_sample_rate} Hz "
                    "(min_sample_rate, max_sample_rate)"
                )
            if nframes / rate > limits.max_audio_seconds:
                raise InputTooLarge(
                    f"audio is {nframes / rate:.1f} s long, over the limit of "
                    f"{limits.max_audio_seconds:g} s (max_audio_seconds)"
                )
            scale = rate / cfg.sample_rate  # input samples per output sample
            need = math.ceil((cfg.max_seconds * cfg.sample_rate + 1) * scale) + 2
            frames = w.readframes(min(nframes, need))
    except InputError:
        raise
    except Exception:  # wave raises wave.Error, EOFError, struct.error... on hostile bytes
        raise InputError("audio could not be decoded (expected a PCM WAV file)") from None
    samples = _pcm_to_float(frames, width, channels)
    total = nframes if len(samples) >= min(nframes, need) else len(samples)  # a cut file
    return samples, total, rate


def _resample_prefix(x: np.ndarray, total: int, rate: int, target: int, n: int) -> np.ndarray:
    """The first n samples of the linear resampling of a `total`-sample signal from `rate` to
    `target`, of which x holds a prefix long enough: what torch's
    interpolate(size=round(total * target / rate), mode="linear") gives over the whole signal
    (up to its float32 rounding of source positions), at a cost bounded by n whatever the
    file's length or rate."""
    size = max(1, round(total * target / rate))
    step = total / size
    pos = np.maximum((np.arange(min(n, size)) + 0.5) * step - 0.5, 0.0)
    i0 = np.minimum(pos.astype(np.int64), total - 1)
    i1 = np.minimum(i0 + 1, total - 1)
    frac = (pos - i0).astype(np.float32)
    return x[i0] * (np.float32(1.0) - frac) + x[i1] * frac


def decode_audio(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """A mono waveform at cfg.sample_rate, cropped or zero-padded to cfg.max_seconds."""
    data = _read_bytes(value, base_dir, "audio", limits)
    samples, total, rate = _read_wav(data, cfg, limits)
    if total == 0:
        raise InputError("audio holds no samples")
    n = math.ceil(cfg.max_seconds * cfg.sample_rate)
    if rate != cfg.sample_rate:
        samples = _resample_prefix(samples, total, rate, cfg.sample_rate, n)
    out = np.zeros(n, dtype=np.float32)
    m = min(n, len(samples))
    out[:m] = samples[:m]
    return torch.from_numpy(out)  # (n,)


def decode(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> Any:
    """Decode one raw input of a modality; the result is what its encoder's collate takes."""
    if value is None:
        raise InputError("value is null")
    if cfg.kind == "vector":
        return decode_vector(value, cfg, limits=limits)
    if cfg.kind == "embedding":
        return decode_embedding(value, cfg, limits)
    if cfg.kind == "text":
        return decode_text(value, limits)
    if cfg.kind == "image":
        return decode_image(value, cfg, base_dir, limits)
    if cfg.kind == "audio":
        return decode_audio(value, cfg, base_dir, limits)
    if cfg.kind == "plugin":
        return decode_plugin(value, cfg, base_dir, limits)
    raise InputError(f"unknown encoder kind {cfg.kind!r}")
