"""The encoder contract: an encoder g_i decodes one raw input of its kind (`decode`), turns a
list of decoded inputs into a batch with its frozen featurizer (`collate`), and maps the batch
to (B, d) unit vectors with its trainable part (`forward`). Training runs `collate` where
records are decoded (DataLoader workers) and `forward` on the device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.runtime import TORCH, Runtime
from models.limits import InputLimits

Featurizer = Callable[[list[Any]], torch.Tensor]


def stack(items: list[Any]) -> torch.Tensor:
    return torch.stack(items)  # (B, ...)


class Encoder(nn.Module, ABC):
    """Base: `collate` runs the frozen featurizer, `forward` the trainable part to (B, d)."""

    def __init__(self, cfg: ModalityConfig):
        super().__init__()
        self.cfg = cfg
        # A plain attribute, not a submodule: frozen weights never enter a checkpoint.
        self.featurizer: Featurizer = stack

    @staticmethod
    @abstractmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        """One raw input -> what `collate` takes; raises models.limits.InputError. `base_dir`
        resolves relative media paths (None for a query, which may not name a file)."""

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        """A decoded input of this kind, for warming the encoder up before it serves; None
        when the kind cannot make one (a plugin's inputs are its own)."""
        return None

    @staticmethod
    def featurizer_for(cfg: ModalityConfig) -> Featurizer:
        """The frozen featurizer of this kind, without the trainable layers (training builds
        it in its DataLoader workers)."""
        return stack

    def collate(self, items: list[Any]) -> torch.Tensor:
        return self.featurizer(list(items))

    def place(
        self, device: torch.device, amp: torch.dtype | None, runtime: Runtime = TORCH
    ) -> None:
        """Run the frozen featurizer on `device` (under autocast to `amp`), or under `runtime`
        (ONNX Runtime), where it is heavy enough to need it (a pretrained tower); the
        trainable part moves with the module."""

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
        return nn.functional.normalize(self.proj(self.features(batch)), dim=-1)  # (B, d)


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.GELU(),
        nn.MaxPool2d(2, ceil_mode=True),
    )


def small_cnn(c_in: int, width: int, hidden: int) -> nn.Sequential:
    """Two conv blocks (width, 2 x width channels), pooled to 4 x 4, then a hidden layer."""
    return nn.Sequential(
        conv_block(c_in, width),
        conv_block(width, 2 * width),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(2 * width * 16, hidden),
        nn.GELU(),
    )
