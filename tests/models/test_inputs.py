from __future__ import annotations

import base64
import io
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.config import ModalityConfig
from models.encoders import decode
from models.limits import InputError, InputLimits, InputTooLarge

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


# Hostile inputs: each is an InputError (never another exception type) and costs little,
# whatever its header claims.

LIMITS = InputLimits(max_image_pixels=4096 * 4096, max_audio_seconds=60.0, max_text_chars=1000)


def wav_header_only(rate: int, width: int, channels: int, frames: bytes) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def truncated_wavs() -> dict[str, bytes]:
    return {
        "odd byte count": wav_bytes(channels=1)[:-1],
        "24-bit cut mid-sample": wav_header_only(16000, 3, 1, bytes(3 * 800))[:-1],
        "stereo cut mid-frame": wav_bytes(channels=2)[:-2],
    }


@pytest.mark.parametrize("name", list(truncated_wavs()))
def test_a_truncated_wav_is_an_input_error(name: str) -> None:
    with pytest.raises(InputError, match=r"audio is truncated: its header declares \d+ frames"):
        decode(truncated_wavs()[name], AUD)


def test_a_wav_with_bytes_after_its_samples_decodes() -> None:
    """Chunks after the data (LIST, id3) are legal: only a file shorter than declared is cut."""
    raw = wav_bytes(channels=1)
    assert torch.equal(decode(raw + b"LIST" + bytes(12), AUD), decode(raw, AUD))


def test_a_wav_that_claims_1_hz_is_refused_before_any_work() -> None:
    raw = wav_header_only(1, 2, 1, bytes(20_000))
    t0 = time.perf_counter()
    with pytest.raises(InputTooLarge, match="sample rate 1 Hz is outside"):
        decode(raw, AUD, limits=LIMITS)
    assert time.perf_counter() - t0 < 0.05


def test_a_long_wav_is_refused_from_its_header() -> None:
    raw = wav_header_only(8000, 2, 1, bytes(2 * 8000 * 61))
    with pytest.raises(InputTooLarge, match=r"61\.0 s long, over the limit of 60 s"):
        decode(raw, AUD, limits=LIMITS)


def test_a_slow_rate_decodes_only_what_the_encoder_keeps() -> None:
    """1 kHz for 60 s: 16x upsampling of the whole clip would be ~1M samples; 0.5 s is kept."""
    raw = wav_header_only(1000, 2, 1, (np.arange(60_000) % 200).astype("<i2").tobytes())
    t0 = time.perf_counter()
    x = decode(raw, AUD, limits=LIMITS)
    assert x.shape == (4000,) and time.perf_counter() - t0 < 0.05


@pytest.mark.parametrize("rate", [7000, 11025, 44100, 48000])
def test_resampling_a_prefix_equals_resampling_the_whole_clip(rate: int) -> None:
    raw = wav_bytes(rate=rate, seconds=2.0, channels=1)
    got = decode(raw, AUD)
    with wave.open(io.BytesIO(raw)) as w:
        whole = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    size = round(len(whole) * AUD.sample_rate / rate)
    want = torch.nn.functional.interpolate(
        torch.from_numpy(whole)[None, None], size=size, mode="linear"
    )[0, 0, :4000]
    assert torch.allclose(got, want, atol=1e-3)


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    buf = io.BytesIO()
    Image.new("L", (20_000, 20_000), 7).save(buf, "PNG")  # 400 MB of pixels in ~400 kB
    t0 = time.perf_counter()
    with pytest.raises(InputTooLarge, match="over the limit of 16777216"):
        decode(buf.getvalue(), IMG, limits=LIMITS)
    assert time.perf_counter() - t0 < 0.5


def test_media_over_the_byte_limit_is_refused_before_base64_decoding() -> None:
    limits = InputLimits(max_media_bytes=1000)
    with pytest.raises(InputTooLarge, match="max_media_bytes"):
        decode(data_uri("image/png", bytes(2000)), IMG, limits=limits)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ([True, 1, 2], InputError, "got a boolean"),
        ([10**400, 1, 2], InputError, "too large for float32"),
        ([1e39, 0, 0], InputError, "too large for float32"),
        ("seven", InputError, "list of numbers"),
    ],
)
def test_hostile_vectors(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        decode(value, VEC)


def test_hostile_texts() -> None:
    txt = ModalityConfig(kind="text")
    with pytest.raises(InputError, match="lone surrogate"):
        decode("seven \ud800", txt)
    with pytest.raises(InputError, match="1001 characters, over the limit of 1000"):
        decode("x" * 1001, txt, limits=LIMITS)


# A data: URI's declared type must be the modality's (or say nothing about the bytes).


@pytest.mark.parametrize(
    ("value", "cfg", "declared"),
    [
        (data_uri("text/plain", png_bytes()), IMG, "text/plain"),
        (data_uri("audio/wav", png_bytes()), IMG, "audio/wav"),
        (data_uri("image/png", wav_bytes()), AUD, "image/png"),
        (data_uri("text/plain", wav_bytes()), AUD, "text/plain"),
    ],
)
def test_a_data_uri_declaring_another_type_is_refused(value: str, cfg, declared: str) -> None:
    with pytest.raises(InputError, match=f"declares the type '{declared}', not {cfg.kind}/"):
        decode(value, cfg)


@pytest.mark.parametrize(
    "mime", ["image/png", "image/jpeg", "IMAGE/PNG", "", "application/octet-stream"]
)
def test_image_types_and_untyped_data_uris_are_read(mime: str) -> None:
    assert decode(data_uri(mime, png_bytes()), IMG).shape == (1, 8, 8)


@pytest.mark.parametrize(
    "mime", ["audio/wav", "audio/x-wav", "audio/wave", "", "application/octet-stream"]
)
def test_audio_types_and_untyped_data_uris_are_read(mime: str) -> None:
    assert decode(data_uri(mime, wav_bytes()), AUD).shape == (4000,)


def test_a_nul_or_a_lone_surrogate_in_a_text_is_an_input_error() -> None:
    text = ModalityConfig(kind="text")
    with pytest.raises(InputError, match=r"holds a NUL character"):
        decode("seven\x00", text)
    with pytest.raises(InputError, match=r"holds a lone surrogate \(\\udc80\)"):
        decode("seven\udc80", text)


def test_a_file_path_without_a_base_directory_is_refused(tmp_path: Path) -> None:
    """A query's value (no records file, no base directory) never names a file to read."""
    (tmp_path / "d.png").write_bytes(png_bytes())
    with pytest.raises(InputError, match="must be a base64 data: URI here"):
        decode(str(tmp_path / "d.png"), IMG)


@pytest.mark.parametrize(
    ("fmt", "at_least", "size"),
    [
        ("JPEG", 224, (320, 240)),  # 1/4: the smallest scale with both sides >= 224
        ("JPEG", 100, (160, 120)),  # 1/8, libjpeg's smallest
        ("JPEG", None, (1280, 960)),
        ("JPEG", 700, (1280, 960)),  # 960 // 700 = 1: whole
        ("PNG", 224, (1280, 960)),  # only JPEG decodes at a smaller scale
    ],
)
def test_a_jpeg_is_decoded_no_larger_than_its_resize_needs(fmt, at_least, size) -> None:
    from models.encoders.image import decode_image_file

    buf = io.BytesIO()
    Image.new("RGB", (1280, 960), (90, 140, 200)).save(buf, fmt)
    image = decode_image_file(buf.getvalue(), InputLimits(), "RGB", at_least)
    assert image.size == size and image.getpixel((10, 10))[2] > 190


def test_a_photo_comes_upright_as_its_exif_orientation_says_and_bad_exif_is_ignored() -> None:
    """A phone stores a portrait photo on its side with EXIF Orientation 6 (turn 90 degrees
    clockwise to view); a malformed EXIF block leaves the pixels as stored, not an error."""
    from models.encoders.image import decode_image_file

    stored = Image.new("RGB", (1200, 900), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 600, 900))  # the stored left half: the top once upright
    portrait = Image.Exif()
    portrait[0x0112] = 6
    for exif, size, top in [
        (portrait.tobytes(), (225, 300), "red"),
        (b"Exif\x00\x00II*\x00\xff\xff\xff\xff not a directory", (300, 225), "blue"),
        (b"", (300, 225), "blue"),
    ]:
        buf = io.BytesIO()
        stored.save(buf, "JPEG", exif=exif)
        image = decode_image_file(buf.getvalue(), InputLimits(), "RGB", 224)
        r, _, b = image.getpixel((image.size[0] // 2, 5))
        assert image.size == size and ("red" if r > b else "blue") == top
