"""`image`: a small CNN for small images (digits, thumbnails), from a PNG, JPEG or any format
Pillow reads, resized to `image_size`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig
from models.encoders.base import ProjectedEncoder, small_cnn
from models.encoders.media import read_bytes
from models.limits import DEFAULT_LIMITS, InputError, InputLimits, InputTooLarge


def decode_image_file(data: bytes, limits: InputLimits, mode: str) -> Any:
    """An image's bytes -> a PIL image in `mode` ("L" or "RGB"), its pixel count checked from
    the header before anything is decompressed."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as opened:
            w, h = opened.size  # from the header: nothing is decompressed yet
            if w * h > limits.max_image_pixels:
                raise InputTooLarge(
                    f"image is {w}x{h} = {w * h} pixels, over the limit of "
                    f"{limits.max_image_pixels} (max_image_pixels)"
                )
            return opened.convert(mode)
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


def decode_image(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    from PIL import Image

    data = read_bytes(value, base_dir, "image", limits)
    img = decode_image_file(data, limits, "L" if cfg.channels == 1 else "RGB")
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
