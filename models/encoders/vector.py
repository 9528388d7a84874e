"""`vector`: an MLP over fixed-length features, for users who bring their own backbone's
outputs; and `embedding`: a tower's own embeddings, used as they are (or through a learned
linear map)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.base import Encoder, ProjectedEncoder
from models.limits import DEFAULT_LIMITS, FLOAT32_MAX, InputError, InputLimits


def decode_vector(
    value: Any, cfg: ModalityConfig, what: str = "vector", limits: InputLimits | None = None
) -> torch.Tensor:
    if not isinstance(value, list | tuple | np.ndarray):
        raise InputError(f"{what} must be a list of numbers, got {type(value).__name__}")
    # A JSON true is not the number 1: numpy would take it as one silently.
    if any(isinstance(v, bool | np.bool_) for v in value):
        raise InputError(f"{what} must be a list of numbers, got a boolean")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except OverflowError:
        raise InputError(f"{what} holds a number too large for float32") from None
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a list of numbers") from None
    if arr.ndim != 1 or arr.shape[0] != cfg.dim:
        got = arr.shape[0] if arr.ndim == 1 else f"shape {arr.shape}"
        raise InputError(f"{what} must have length {cfg.dim}, got {got}")
    if not np.isfinite(arr).all():
        raise InputError(f"{what} holds NaN or infinite values")
    if arr.size and float(np.abs(arr).max()) > FLOAT32_MAX:
        raise InputError(f"{what} holds a number too large for float32 (|x| > 3.4e38)")
    bound = (limits or DEFAULT_LIMITS).max_abs_value
    if arr.size and float(np.abs(arr).max()) > bound:
        raise InputError(f"{what} holds a number beyond +-{bound:g} (max_abs_value)")
    return torch.from_numpy(arr.astype(np.float32))  # (dim,)


class VectorEncoder(ProjectedEncoder):
    """An MLP over fixed-length features."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        assert cfg.dim is not None
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.GELU(),
        )

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_vector(value, cfg, limits=limits)

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        assert cfg.dim is not None
        return torch.ones(cfg.dim)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.mlp(batch)  # (B, hidden)


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

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        assert cfg.dim is not None
        return torch.ones(cfg.dim)

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        """The encoder L2-normalises it, so it needs a direction."""
        x = decode_vector(value, cfg, "embedding", limits)
        if not bool(x.any()):
            raise InputError("embedding is all zeros: it has no direction to normalise")
        return x  # (dim,)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = nn.functional.normalize(batch, dim=-1)  # (B, dim)
        if self.linear is not None:
            x = nn.functional.normalize(self.linear(x), dim=-1)  # (B, d)
        return x
