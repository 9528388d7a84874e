"""`image`: a small CNN for small images (digits, thumbnails), from a PNG, JPEG or any format
Pillow reads, resized to `image_size`."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig
from models.encoders.base import ProjectedEncoder, small_cnn
from models.encoders.media import read_bytes
from models.limits import DEFAULT_LIMITS, InputError, InputLimits, InputTooLarge

UNREADABLE = "image could not be decoded (not a PNG, JPEG or other known format)"


def _over(pixels: str, limits: InputLimits) -> InputTooLarge:
    return InputTooLarge(
        f"image is {pixels}, over the limit of {limits.max_image_pixels} (max_image_pixels)"
    )


def image_pixels(data: bytes, limits: InputLimits) -> int:
    """width x height from an image's header, nothing decompressed: what decoding it costs.
    Raises InputTooLarge over max_image_pixels, InputError when no header is readable."""
    from PIL import Image

    failure: InputError | None = None
    try:
        with Image.open(io.BytesIO(data)) as opened:
            w, h = opened.size
            opened.close()
    except Image.DecompressionBombError:  # PIL's own guard, for the largest headers
        failure = _over("more pixels than PIL opens", limits)
    except Exception:  # PIL's openers raise many undocumented types on hostile bytes
        failure = InputError(UNREADABLE)
    if failure is None and w * h > limits.max_image_pixels:
        failure = _over(f"{w}x{h} = {w * h} pixels", limits)
    if failure is not None:
        raise failure  # outside the except blocks: no context chain back to PIL's frames
    return w * h


def decode_image_file(
    data: bytes, limits: InputLimits, mode: str, at_least: int | None = None
) -> Any:
    """An image's bytes -> a PIL image in `mode` ("L" or "RGB"), its pixel count checked from
    the header before anything is decompressed.

    `at_least`: the side the caller resizes the image to (or below). A JPEG is then decoded at
    the smallest of libjpeg's scales (1/2, 1/4, 1/8) that keeps both sides at least that long,
    Pillow's `draft` (as its own `Image.thumbnail` does): a 1080p photo bound for 224 x 224
    decodes twice as fast, a 12-megapixel one 4 to 5 times, and once resized its pixels are
    on average 0.3 to 1.6 grey levels from the whole decode's (benchmarks/bench_image_decode.py).
    Other formats are decoded whole. The image comes upright, as its EXIF orientation says.

    The source's pixels are released on every path: a decode that fails part-way has already
    allocated the whole image, and an error whose traceback kept a frame holding it would keep
    that memory for as long as the error lives."""
    from PIL import Image

    image_pixels(data, limits)
    opened = None
    try:
        opened = Image.open(io.BytesIO(data))
        if at_least is not None and opened.format == "JPEG":
            opened.draft(opened.mode, (at_least, at_least))  # its own mode: only the scale
        image = opened.convert(mode)
    except Exception:  # PIL's decoders raise many undocumented types on hostile bytes
        image = None
    finally:
        if opened is not None:
            opened.close()  # frees the source's pixels, decoded or half-decoded
    if image is None:
        raise InputError(UNREADABLE)  # outside the except block: no context chain to PIL's frames
    return upright(image)


def upright(image: Any) -> Any:
    """`image` turned as its EXIF Orientation tag says (a phone's portrait photo is stored on
    its side with that tag), in place, as transformers' `load_image` does; an image whose EXIF
    cannot be read is left as it was stored."""
    from PIL import ImageOps

    with contextlib.suppress(Exception):  # a malformed EXIF block: the pixels decoded, keep them
        ImageOps.exif_transpose(image, in_place=True)
    return image


def decode_image(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    from PIL import Image

    data = read_bytes(value, base_dir, "image", limits)
    img = decode_image_file(data, limits, "L" if cfg.channels == 1 else "RGB", cfg.image_size)
    img = img.resize((cfg.image_size, cfg.image_size), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) / 255.0
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)  # (C, H, W)
    return torch.from_numpy(np.ascontiguousarray(arr))


class ImageEncoder(ProjectedEncoder):
    """Two conv blocks, pooled to 4x4, then the projection."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.cnn = small_cnn(cfg.channels, cfg.conv_width, cfg.hidden)

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_image(value, cfg, base_dir, limits)

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        return torch.zeros(cfg.channels, cfg.image_size, cfg.image_size)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(batch)  # (B, hidden)
