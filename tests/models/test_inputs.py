from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.config import ModalityConfig
from models.inputs import InputError, decode

VEC = ModalityConfig(kind="vector", dim=3)
IMG = ModalityConfig(kind="image", image_size=8)
AUD = ModalityConfig(kind="audio", sample_rate=8000, max_seconds=0.5)


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.arange(256).reshape(16, 16) % 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wav_bytes(rate: int = 16000, seconds: float = 0.25, channels: int = 2) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(x, channels).tobytes())
    return buf.getvalue()


def data_uri(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def test_vector() -> None:
    assert decode([1, 2, 3], VEC).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(InputError, match="length 3, got 2"):
        decode([1, 2], VEC)
    with pytest.raises(InputError, match="NaN or infinite"):
        decode([1, float("nan"), 3], VEC)
    with pytest.raises(InputError, match="list of numbers"):
        decode(["x", 1, 2], VEC)


def test_image_from_path_and_data_uri(tmp_path: Path) -> None:
    (tmp_path / "d.png").write_bytes(png_bytes())
    from_path = decode("d.png", IMG, tmp_path)
    from_uri = decode(data_uri("image/png", png_bytes()), IMG)
    assert from_path.shape == (1, 8, 8) and from_path.equal(from_uri)
    assert float(from_path.min()) >= 0.0 and float(from_path.max()) <= 1.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("missing.png", "image file not found"),
        (data_uri("image/png", b"not an image"), "could not be decoded"),
        ("data:image/png;base64,@@@", "invalid base64"),
        ("data:image/png,raw", "base64 encoded"),
        (17, "expected a file path"),
    ],
)
def test_bad_images(tmp_path: Path, value: object, message: str) -> None:
    with pytest.raises(InputError, match=message):
        decode(value, IMG, tmp_path)


def test_audio_is_mixed_resampled_and_padded() -> None:
    x = decode(data_uri("audio/wav", wav_bytes()), AUD)
    assert x.shape == (4000,)
    assert float(x[:2000].abs().max()) == pytest.approx(0.5, abs=0.01)
    assert float(x[2100:].abs().max()) == 0.0  # zero padding past the clip's 0.25 s


def test_bad_audio() -> None:
    with pytest.raises(InputError, match="PCM WAV"):
        decode(data_uri("audio/wav", b"RIFF....WAVEjunk"), AUD)
