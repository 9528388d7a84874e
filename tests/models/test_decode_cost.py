"""A raw medium's decode cost, from its header: the service's per-request budget reads it."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from models.config import ModalityConfig
from models.encoders.decode_cost import HEADER_BYTES, decode_cost
from models.limits import DEFAULT_LIMITS, InputError, InputTooLarge
from tests.app.test_hostile import wav

IMG = ModalityConfig.from_dict({"kind": "image", "image_size": 8}, "m")
AUD = ModalityConfig.from_dict({"kind": "audio", "max_seconds": 0.25}, "m")


def uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_an_image_costs_its_pixels_and_a_clip_the_seconds_its_encoder_reads() -> None:
    buf = io.BytesIO()
    Image.new("L", (300, 200), 9).save(buf, "PNG")
    assert decode_cost(uri("image/png", buf.getvalue()), IMG, DEFAULT_LIMITS) == 60_000
    assert decode_cost(uri("audio/wav", wav(300, seconds=0.1)), AUD, DEFAULT_LIMITS) == 0.1
    assert decode_cost(uri("audio/wav", wav(300, seconds=2.0)), AUD, DEFAULT_LIMITS) == 0.25


def test_a_jpeg_whose_header_lies_past_the_prefix_is_read_whole() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (640, 480), (1, 2, 3)).save(buf, "JPEG", icc_profile=bytes(2 * HEADER_BYTES))
    assert buf.getvalue().find(b"\xff\xc0") > HEADER_BYTES  # its size comes after the profile
    assert decode_cost(uri("image/jpeg", buf.getvalue()), IMG, DEFAULT_LIMITS) == 640 * 480


def test_junk_is_refused_from_its_prefix_without_decoding_the_rest() -> None:
    # past the prefix the base64 is broken: reading the whole input would say so instead
    junk = uri("image/png", b"\x89PNG" + bytes(2 * HEADER_BYTES)) + "!!!!"
    with pytest.raises(InputError, match="image could not be decoded"):
        decode_cost(junk, IMG, DEFAULT_LIMITS)
    jpeg = uri("image/jpeg", b"\xff\xd8" + bytes(2 * HEADER_BYTES)) + "!!!!"
    with pytest.raises(InputError, match="invalid base64"):  # a JPEG's header may lie further
        decode_cost(jpeg, IMG, DEFAULT_LIMITS)


def test_a_header_over_the_pixel_limit_is_too_large() -> None:
    buf = io.BytesIO()
    Image.new("L", (5000, 5000), 0).save(buf, "PNG")
    limits = DEFAULT_LIMITS.__class__(max_image_pixels=4096 * 4096)
    with pytest.raises(InputTooLarge, match="max_image_pixels"):
        decode_cost(uri("image/png", buf.getvalue()), IMG, limits)
