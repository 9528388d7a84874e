"""A pretrained tower's inputs: raw values decoded and preprocessed as its processor wants them
(images resized and normalised, audio resampled to its rate), and an example of one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModalityConfig
from models.encoders.audio import _read_wav
from models.encoders.image import decode_image_file
from models.encoders.media import read_bytes
from models.encoders.text_input import decode_text
from models.encoders.towers import load_processor
from models.limits import DEFAULT_LIMITS, InputError, InputLimits


def example_input(cfg: ModalityConfig) -> Any:
    if cfg.input == "text":
        return "a first query"
    if cfg.input == "image":
        from PIL import Image

        return preprocess_image(Image.new("RGB", (32, 32), (127, 127, 127)), cfg)
    rate = load_processor(cfg).sampling_rate or 16000
    t = np.arange(rate // 4, dtype=np.float32) / rate
    return torch.from_numpy(0.1 * np.sin(2 * np.pi * 440.0 * t).astype(np.float32))


def decode_pretrained(
    value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits = DEFAULT_LIMITS
) -> Any:
    """A raw input of the modality's input kind -> what the tower's batch is made of: a string,
    an image's pixel tensor as its image processor makes it (resized, cropped, normalised: done
    here, in the reader processes and DataLoader workers, so that a decoded image has the
    model's input size rather than the photo's), or a mono waveform at the processor's rate
    (cropped to max_seconds)."""
    if cfg.input == "text":
        return decode_text(value, limits)
    if cfg.input == "image":
        data = read_bytes(value, base_dir, "image", limits)
        return preprocess_image(decode_image_file(data, limits, "RGB", image_side(cfg)), cfg)
    data = read_bytes(value, base_dir, "audio", limits)
    # 10 ms past max_seconds: the resampling filter's reach, so the crop has no edge effect
    samples, total, rate = _read_wav(data, cfg, limits, margin_s=0.01)
    if total == 0:
        raise InputError("audio holds no samples")
    target = cfg.sample_rate
    n = min(math.ceil(cfg.max_seconds * target), max(1, round(total * target / rate)))
    if rate != target:
        samples = resample(samples, rate, target)
    return torch.from_numpy(np.ascontiguousarray(samples[:n], dtype=np.float32))


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """`x` at `target` Hz, low-pass filtered first (scipy's polyphase resampler): a pretrained
    speech or sound model heard its training audio resampled so, and a plain interpolation
    would fold what lies above target/2 (a 44.1 kHz recording's upper half) into its band."""
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return np.asarray(resample_poly(x, target // g, rate // g), dtype=np.float32)


SIDES = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")


def image_side(cfg: ModalityConfig) -> int | None:
    """The longest side the tower's image processor resizes or crops an image to (see
    processor_side)."""
    return processor_side(load_processor(cfg).processor)


def processor_side(processor: Any) -> int | None:
    """The longest side a transformers image processor resizes or crops an image to: an image
    whose sides are all at least that long loses nothing the processor keeps
    (models.encoders.image decodes a JPEG no smaller). None where the processor keeps an
    image's own size, sizes it by pixel count, or gives its size in a form not known here."""
    if not getattr(processor, "do_resize", False):
        return None
    sides: list[int] = []
    for size in (getattr(processor, "size", None), getattr(processor, "crop_size", None)):
        if size is None:
            continue
        if isinstance(size, int):
            sides.append(size)
            continue
        fields = size if isinstance(size, dict) else getattr(size, "__dict__", None)
        if not isinstance(fields, dict) or fields.get("min_pixels") or fields.get("max_pixels"):
            return None  # a JPEG decoded whole, as before: never smaller than it must be
        sides += [int(v) for k, v in fields.items() if k in SIDES and isinstance(v, int) and v]
    return max(sides) if sides else None


def preprocess_image(image: Any, cfg: ModalityConfig) -> torch.Tensor:
    """An RGB PIL image -> (C, H, W) float32 pixels, by the tower's own image processor."""
    pixels = load_processor(cfg).processor(images=[image], return_tensors="pt")["pixel_values"]
    return torch.as_tensor(pixels[0], dtype=torch.float32).contiguous()


def pixels_bytes(cfg: ModalityConfig) -> int:
    """The size of one preprocessed image (models.encoders.decoded_bytes)."""
    example = example_input(cfg)
    return int(example.numel() * example.element_size())
