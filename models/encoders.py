"""Encoders g_i: one per input kind, each ending in a projection to the latent d and L2 norm.

An encoder takes a list of decoded inputs (models.inputs.decode) through `collate` (its frozen
featurizer, models.featurizers) and returns (B, d) unit vectors from `forward` (its trainable
part). Training runs the two apart: `collate` where records are decoded, `forward` on the device.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from models.audio import LogMel
from models.config import ModalityConfig
from models.featurizers import Featurizer, PluginFeatures, TextFeatures, stack
from models.text_backbone import BACKBONE_DIM


class Encoder(nn.Module, ABC):
    """Base: `collate` runs the frozen featurizer, `forward` the trainable part to (B, d)."""

    def __init__(self, cfg: ModalityConfig):
        super().__init__()
        self.cfg = cfg
        # A plain attribute, not a submodule: frozen weights never enter a checkpoint.
        self.featurizer: Featurizer = stack

    def collate(self, items: list[Any]) -> torch.Tensor:
        return self.featurizer(list(items))

    @abstractmethod
    def forward(self, batch: Any) -> torch.Tensor:
        """A collated batch -> (B, d) unit vectors."""

    def encode(self, items: list[Any]) -> torch.Tensor:
        return self(self.collate(items))


class ProjectedEncoder(Encoder):
    """A trunk producing features, then the projection and the L2 normalisation."""

    def __init__(self, cfg: ModalityConfig, features: int, latent_dim: int):
        super().__init__(cfg)
        self.proj = nn.Linear(features, latent_dim)

    @abstractmethod
    def features(self, batch: Any) -> torch.Tensor:
        """The trunk: (B, features) before the projection."""

    def forward(self, batch: Any) -> torch.Tensor:
        # Layers are called as functions where that is all they are: the same operations
        # without nn.Module's call machinery, which the service pays per query on its event
        # loop (a vector MLP measured 52 against 68 us, and 480-520 against 590-640 us once a
        # search has evicted that machinery from the cache).
        z = nn.functional.linear(self.features(batch), self.proj.weight, self.proj.bias)
        return nn.functional.normalize(z, dim=-1)  # (B, d)


class VectorEncoder(ProjectedEncoder):
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
        # Linear, GELU, Linear, GELU
        first, second = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])
        h = nn.functional.gelu(nn.functional.linear(batch, first.weight, first.bias))
        return nn.functional.gelu(nn.functional.linear(h, second.weight, second.bias))

    def numpy_forward(self) -> Callable[[np.ndarray], np.ndarray]:
        """`forward` as a numpy function of (B, dim) float32 arrays, with the weights as they
        are now (a serving version's model is not trained further). The same operations, equal
        within float32 rounding (tests/models/test_encoders.py).

        Why: the service encodes a lone query on its event loop right after a search has
        streamed the view through the cache, and torch's dispatch then costs 420-480 us for
        one 64-d input against 145-150 us for these few numpy calls (40-47 us each when warm;
        measured on a Zen 5 EPYC). Its exact GELU takes math.erf element by element, so past
        a few rows torch is the faster: the service uses this for small batches only."""
        first, second = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])

        def taken(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy().astype(np.float32)  # a copy

        # (out, in) weights as (in, out), so that a row of inputs multiplies from the left
        w1, w2, wp = (np.ascontiguousarray(taken(x.weight).T) for x in (first, second, self.proj))
        b1, b2, bp = (taken(x.bias) for x in (first, second, self.proj))

        def run(x: np.ndarray) -> np.ndarray:
            # An input near float32's limit overflows here as in torch (the caller checks the
            # output is finite); numpy would also warn about it, torch does not.
            with np.errstate(all="ignore"):
                h = _gelu(_gelu(x @ w1 + b1) @ w2 + b2)
                z = h @ wp + bp
                norm = np.linalg.norm(z, axis=1, keepdims=True)
                return z / np.maximum(norm, np.float32(NORMALIZE_EPS))  # as F.normalize

        return run


NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's default eps
_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x * Phi(x), in float32 (torch's nn.GELU() default, not the tanh form)."""
    phi = np.asarray(_erf(x * np.float32(1 / math.sqrt(2))), dtype=np.float32)
    return np.float32(0.5) * x * (np.float32(1.0) + phi)


class EmbeddingEncoder(Encoder):
    """Embeddings from the user's own tower, used as they are: L2-normalised and, only when the
    config asks (`"map": "linear"`), sent through a learned linear map to the latent d."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg)
        assert cfg.dim is not None
        self.linear: nn.Linear | None = None
        if cfg.map == "linear":
            self.linear = nn.Linear(cfg.dim, latent_dim, bias=False)
            # Start from the tower's own geometry: the identity when the widths agree, else an
            # orthogonal map, which keeps inner products as far as a change of width allows.
            with torch.no_grad():
                if cfg.dim == latent_dim:
                    self.linear.weight.copy_(torch.eye(latent_dim))
                else:
                    nn.init.orthogonal_(self.linear.weight)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = nn.functional.normalize(batch, dim=-1)  # (B, dim)
        if self.linear is not None:
            x = nn.functional.normalize(self.linear(x), dim=-1)  # (B, d)
        return x


class TextEncoder(ProjectedEncoder):
    """Frozen MiniLM sentence embeddings followed by a trainable MLP head."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.featurizer = TextFeatures()  # (B, 384), cached per sentence
        self.head = nn.Sequential(nn.Linear(BACKBONE_DIM, cfg.hidden), nn.GELU())

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch)


class PluginEncoder(ProjectedEncoder):
    """A plugin's frozen tower (models.plugins) followed by a trainable MLP head."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        features = PluginFeatures(cfg)
        self.featurizer = features  # (B, feature_dim)
        self.head = nn.Sequential(nn.Linear(features.dim, cfg.hidden), nn.GELU())

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


class ImageEncoder(ProjectedEncoder):
    """A small CNN for small images (digits, thumbnails): two conv blocks, pooled to 4x4."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.cnn = _cnn(cfg.channels, cfg.conv_width, cfg.hidden)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(batch)  # (B, hidden)


class AudioEncoder(ProjectedEncoder):
    """Log-mel spectrogram of the waveform, then the same small CNN as for images."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.logmel = LogMel(cfg.sample_rate, cfg.n_mels, hop_ms=cfg.hop_ms)
        self.cnn = _cnn(1, cfg.conv_width, cfg.hidden)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.logmel(batch))  # (B, hidden)


ENCODERS: dict[str, Callable[[ModalityConfig, int], Encoder]] = {
    "vector": VectorEncoder,
    "embedding": EmbeddingEncoder,
    "text": TextEncoder,
    "image": ImageEncoder,
    "audio": AudioEncoder,
    "plugin": PluginEncoder,
}


def build_encoder(cfg: ModalityConfig, latent_dim: int) -> Encoder:
    return ENCODERS[cfg.kind](cfg, latent_dim)
