"""Decoding raw inputs (DESIGN §3) into the tensors the encoders take.

Raw inputs are what records and queries carry: a string for `text`, a file path or a base64
`data:` URI for `image` and `audio`, a list of floats for `vector`. Every failure raises
InputError with a message that says what is wrong with the value; callers add the record or
field it came from.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig


class InputError(ValueError):
    """A raw input cannot be decoded for its modality."""


def _read_bytes(value: Any, base_dir: Path | None, what: str) -> bytes:
    """Bytes of a path (relative to base_dir) or of a base64 data: URI."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise InputError(
            f"expected a file path or a data: URI for {what}, got {type(value).__name__}"
        )
    if value.startswith("data:"):
        header, sep, payload = value.partition(",")
        if not sep or ";base64" not in header:
            raise InputError(f"{what} data: URI must be base64 encoded ('data:...;base64,...')")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"{what} data: URI holds invalid base64") from None
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"{what} file unreadable: {path}: {exc.strerror}") from None


def decode_vector(value: Any, cfg: ModalityConfig) -> torch.Tensor:
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError("vector must be a list of numbers") from None
    if arr.ndim != 1 or arr.shape[0] != cfg.dim:
        got = arr.shape[0] if arr.ndim == 1 else f"shape {arr.shape}"
        raise InputError(f"vector must have length {cfg.dim}, got {got}")
    if not np.isfinite(arr).all():
        raise InputError("vector holds NaN or infinite values")
    return torch.from_numpy(arr)  # (dim,)


def decode_text(value: Any) -> str:
    if not isinstance(value, str):
        raise InputError(f"text must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InputError("text is empty")
    return value


def decode_image(value: Any, cfg: ModalityConfig, base_dir: Path | None = None) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    data = _read_bytes(value, base_dir, "image")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            img = opened.convert("L" if cfg.channels == 1 else "RGB")
            img = img.resize((cfg.image_size, cfg.image_size), Image.Resampling.BILINEAR)
            arr = np.asarray(img, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InputError(
            "image could not be decoded (not a PNG, JPEG or other known format)"
        ) from None
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)  # (C, H, W)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _pcm_to_float(frames: bytes, width: int, channels: int) -> np.ndarray:
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


def decode_audio(value: Any, cfg: ModalityConfig, base_dir: Path | None = None) -> torch.Tensor:
    """A mono waveform at cfg.sample_rate, cropped or zero-padded to cfg.max_seconds."""
    data = _read_bytes(value, base_dir, "audio")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, ValueError):
        raise InputError("audio could not be decoded (expected a PCM WAV file)") from None
    if rate <= 0 or channels <= 0:
        raise InputError("audio WAV header is invalid")
    x = torch.from_numpy(_pcm_to_float(frames, width, channels).copy())  # (T,)
    if x.numel() == 0:
        raise InputError("audio holds no samples")
    if rate != cfg.sample_rate:
        n_out = max(1, round(x.numel() * cfg.sample_rate / rate))
        x = torch.nn.functional.interpolate(x[None, None], size=n_out, mode="linear")[0, 0]
    n = math.ceil(cfg.max_seconds * cfg.sample_rate)
    out = torch.zeros(n)
    out[: min(n, x.numel())] = x[:n]
    return out  # (n,)


def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None = None) -> Any:
    """Decode one raw input of a modality; the result is what its encoder's collate takes."""
    if value is None:
        raise InputError("value is null")
    if cfg.kind == "vector":
        return decode_vector(value, cfg)
    if cfg.kind == "text":
        return decode_text(value)
    if cfg.kind == "image":
        return decode_image(value, cfg, base_dir)
    if cfg.kind == "audio":
        return decode_audio(value, cfg, base_dir)
    raise InputError(f"unknown encoder kind {cfg.kind!r}")
