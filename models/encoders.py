"""Encoders g_i: one per input kind, each ending in a projection to the latent d and L2 norm.

An encoder takes a list of decoded inputs (models.inputs.decode) through `collate` and returns
(B, d) unit vectors from `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.audio import LogMel
from models.config import ModalityConfig
from models.text_backbone import BACKBONE_DIM, shared_backbone


class Encoder(nn.Module, ABC):
    """Base: a trunk producing features, then the projection and the L2 normalisation."""

    def __init__(self, cfg: ModalityConfig, features: int, latent_dim: int):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Linear(features, latent_dim)

    def collate(self, items: list[Any]) -> torch.Tensor:
        return torch.stack(items)

    @abstractmethod
    def features(self, batch: Any) -> torch.Tensor:
        """The trunk: (B, features) before the projection."""

    def forward(self, batch: Any) -> torch.Tensor:
        z = self.proj(self.features(batch))  # (B, d)
        return nn.functional.normalize(z, dim=-1)

    def encode(self, items: list[Any]) -> torch.Tensor:
        return self(self.collate(items))


class VectorEncoder(Encoder):
    """An MLP over fixed-length features, for users who bring their own backbone's outputs."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        assert cfg.dim is not None
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.GELU(),
        )

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.mlp(batch)  # (B, hidden)


class TextEncoder(Encoder):
    """Frozen MiniLM sentence embeddings followed by a trainable MLP head."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        # Held outside the module tree so its weights never enter a checkpoint or an optimiser.
        self.backbone = shared_backbone()
        self.head = nn.Sequential(nn.Linear(BACKBONE_DIM, cfg.hidden), nn.GELU())

    def collate(self, items: list[Any]) -> torch.Tensor:
        return self.backbone.embed(list(items))  # (B, 384)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch)


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.GELU(),
        nn.MaxPool2d(2, ceil_mode=True),
    )


def _cnn(c_in: int, width: int, hidden: int) -> nn.Sequential:
    """Two conv blocks (width, 2 x width channels), pooled to 4 x 4, then a hidden layer."""
    return nn.Sequential(
        _conv_block(c_in, width),
        _conv_block(width, 2 * width),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(2 * width * 16, hidden),
        nn.GELU(),
    )


class ImageEncoder(Encoder):
    """A small CNN for small images (digits, thumbnails): two conv blocks, pooled to 4x4."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.cnn = _cnn(cfg.channels, cfg.conv_width, cfg.hidden)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(batch)  # (B, hidden)


class AudioEncoder(Encoder):
    """Log-mel spectrogram of the waveform, then the same small CNN as for images."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.logmel = LogMel(cfg.sample_rate, cfg.n_mels, hop_ms=cfg.hop_ms)
        self.cnn = _cnn(1, cfg.conv_width, cfg.hidden)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.logmel(batch))  # (B, hidden)


ENCODERS: dict[str, Callable[[ModalityConfig, int], Encoder]] = {
    "vector": VectorEncoder,
    "text": TextEncoder,
    "image": ImageEncoder,
    "audio": AudioEncoder,
}


def build_encoder(cfg: ModalityConfig, latent_dim: int) -> Encoder:
    return ENCODERS[cfg.kind](cfg, latent_dim)
