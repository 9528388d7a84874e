"""The multimodal model: one encoder per modality and a scoring head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from models.config import ModelConfig
from models.encoders import Encoder, build_encoder, stack
from models.heads import Head, build_head
from models.plugins import resolve_options


class MultimodalModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg = resolve_options(cfg)  # plugins found, their options completed
        self.encoders = nn.ModuleDict(
            {n: build_encoder(cfg.modalities[n], cfg.latent_dim) for n in cfg.names}
        )
        self.head: Head = build_head(cfg.head, cfg.names, cfg.latent_dim)

    @property
    def names(self) -> list[str]:
        return self.cfg.names

    def encoder(self, modality: str) -> Encoder:
        if modality not in self.encoders:
            raise ValueError(f"unknown modality {modality!r} (known: {', '.join(self.names)})")
        enc = self.encoders[modality]
        assert isinstance(enc, Encoder)
        return enc

    def encode(self, modality: str, items: Sequence[Any]) -> torch.Tensor:
        """(B, d) unit embeddings of decoded inputs; the service and the indexer call this."""
        return self.encoder(modality).encode(list(items))

    def encode_batch(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        """(B, d) unit embeddings of a (B, dim) batch of fixed-length inputs (`vector` and
        `embedding` kinds): what `encode(modality, list(batch))` returns, without splitting
        the batch into rows for the featurizer to stack back. Kinds whose featurizer does more
        than stack take that path."""
        enc = self.encoder(modality)
        if enc.featurizer is not stack:
            return enc.encode(list(batch))
        return enc(batch)

    def forward(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Collated inputs per modality -> (B, d) embeddings per modality (training path)."""
        return {n: self.encoders[n](batch[n]) for n in batch}
