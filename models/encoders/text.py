"""`text`: frozen MiniLM sentence embeddings (models.encoders.minilm) followed by a trainable
MLP head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.base import Featurizer, ProjectedEncoder
from models.encoders.minilm import BACKBONE_DIM, backbone_config, shared_backbone
from models.encoders.runtime import TORCH, Runtime
from models.encoders.text_input import decode_text
from models.limits import InputLimits


class TextFeatures:
    """Sentences -> (B, 384) MiniLM embeddings, cached per sentence in each process."""

    def __init__(self, runtime: Runtime = TORCH):
        self.runtime = runtime

    def __call__(self, items: list[Any]) -> torch.Tensor:
        return shared_backbone(self.runtime).embed(list(items))  # (B, 384)


class TextEncoder(ProjectedEncoder):
    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        self.featurizer = TextFeatures()
        self.head = nn.Sequential(nn.Linear(BACKBONE_DIM, cfg.hidden), nn.GELU())

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_text(value, limits)

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        return "a first query"

    @staticmethod
    def featurizer_for(cfg: ModalityConfig) -> Featurizer:
        return TextFeatures()

    def place(
        self, device: torch.device, amp: torch.dtype | None, runtime: Runtime = TORCH
    ) -> None:
        self.featurizer = TextFeatures(runtime)
        if runtime.onnx:
            from models.encoders.onnx_runtime import load_onnx_tower

            load_onnx_tower(backbone_config(), runtime)  # exported now, not at the first query

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch)
