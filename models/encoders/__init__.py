"""Encoders g_i, one per input kind, each ending in a projection to the latent d and L2 norm,
and each decoding its own raw inputs (docs/design.md §3)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from models.config import ModalityConfig
from models.encoders.audio import AudioEncoder
from models.encoders.base import Encoder, Featurizer, stack
from models.encoders.image import ImageEncoder
from models.encoders.plugin import PluginEncoder
from models.encoders.pretrained import PretrainedEncoder
from models.encoders.text import TextEncoder
from models.encoders.vector import EmbeddingEncoder, VectorEncoder
from models.limits import DEFAULT_LIMITS, InputError, InputLimits, string_problem

ENCODERS: dict[str, type[Encoder]] = {
    "vector": VectorEncoder,
    "embedding": EmbeddingEncoder,
    "text": TextEncoder,
    "image": ImageEncoder,
    "audio": AudioEncoder,
    "plugin": PluginEncoder,
    "transformers": PretrainedEncoder,
}

__all__ = [
    "ENCODERS",
    "Encoder",
    "Featurizer",
    "build_encoder",
    "decode",
    "decoded_bytes",
    "featurizer",
    "stack",
]
TEXT_BYTES = 1024  # a caption or a sentence; the limit (max_text_chars) is far above typical


def build_encoder(cfg: ModalityConfig, latent_dim: int) -> Encoder:
    return ENCODERS[cfg.kind](cfg, latent_dim)  # type: ignore[call-arg]


def featurizer(cfg: ModalityConfig) -> Featurizer:
    """The kind's frozen first stage alone (no trainable layers): for DataLoader workers."""
    return ENCODERS[cfg.kind].featurizer_for(cfg)


def decode(
    value: Any,
    cfg: ModalityConfig,
    base_dir: Path | None = None,
    limits: InputLimits = DEFAULT_LIMITS,
) -> Any:
    """Decode one raw input of a modality with its encoder's decoder; the result is what that
    encoder's collate takes. Every failure is an InputError saying what is wrong with the value."""
    if value is None:
        raise InputError("value is null")
    problem = string_problem(value) if isinstance(value, str) else None
    if problem is not None:  # a text, a path or a plugin's string: never a crash further on
        raise InputError(f"the value {problem}")
    encoder = ENCODERS.get(cfg.kind)
    if encoder is None:
        raise InputError(f"unknown encoder kind {cfg.kind!r}")
    return encoder.decode(value, cfg, base_dir, limits)


def decoded_bytes(cfg: ModalityConfig) -> int | None:
    """About how many bytes one decoded input of this modality holds (what a reader process
    sends the encoder): index builds size their chunks by it, so a chunk of media stays a few
    tens of MB. None for a plugin, whose inputs are its own."""
    form = cfg.raw_form
    if form in ("vector", "embedding"):
        return 4 * (cfg.dim or 1)
    if form == "text":
        return TEXT_BYTES
    if form == "audio":
        return 4 * math.ceil(cfg.sample_rate * cfg.max_seconds)
    if cfg.kind == "image":
        return 4 * cfg.channels * cfg.image_size**2
    if cfg.kind == "transformers":
        from models.encoders.tower_inputs import pixels_bytes

        return pixels_bytes(cfg)
    return None
