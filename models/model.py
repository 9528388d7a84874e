"""The multimodal model: one encoder per modality and a scoring head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from models.config import ConfigError, ModelConfig
from models.device import autocast_dtype, resolve_device, to_device
from models.encoders import Encoder, build_encoder, stack
from models.encoders.runtime import TORCH, Runtime
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
        # Where encode() runs (to_inference): inputs are moved there, outputs come back as
        # float32 on the CPU, whatever the device and precision.
        self.run_device = torch.device("cpu")
        self.run_amp: torch.dtype | None = None

    def to_inference(
        self,
        device: str = "auto",
        precision: str = "auto",
        field: str = "device",
        runtime: Runtime = TORCH,
    ) -> MultimodalModel:
        """Encode on `device` (auto: CUDA when torch sees one), under bf16 autocast where
        `precision` asks for it (auto: on a GPU that supports it), the frozen pretrained
        towers under `runtime` (ONNX Runtime: on the CPU); `field` names the setting in
        errors. Returns the model, moved there and in eval mode."""
        self.run_device = resolve_device(device, field)
        self.run_amp = autocast_dtype(precision, self.run_device, field)
        if runtime.onnx and self.run_device.type != "cpu":
            raise ConfigError(
                f"encoder runtime {runtime.name} runs the towers on the CPU, and {field} "
                f"gives {self.run_device.type}: set it to cpu, or the runtime to torch"
            )
        self.to(self.run_device)
        for enc in self.encoders.values():
            assert isinstance(enc, Encoder)
            enc.place(self.run_device, self.run_amp, runtime)  # frozen towers: not submodules
        self.eval()
        return self

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
        enc = self.encoder(modality)
        return self._run(enc, enc.collate(list(items)))

    def _run(self, enc: Encoder, batch: Any) -> torch.Tensor:
        if self.run_device.type == "cpu" and self.run_amp is None:
            return enc(batch)
        with torch.autocast(self.run_device.type, self.run_amp, enabled=self.run_amp is not None):
            out = enc(to_device(batch, self.run_device))
        return out.float().cpu()

    def encode_batch(self, modality: str, batch: torch.Tensor) -> torch.Tensor:
        """(B, d) unit embeddings of a (B, dim) batch of fixed-length inputs (`vector` and
        `embedding` kinds): what `encode(modality, list(batch))` returns, without splitting
        the batch into rows for the featurizer to stack back. Kinds whose featurizer does more
        than stack take that path."""
        enc = self.encoder(modality)
        if enc.featurizer is not stack:
            return self.encode(modality, list(batch))
        return self._run(enc, batch)

    def forward(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Collated inputs per modality -> (B, d) embeddings per modality (training path)."""
        return {n: self.encoders[n](batch[n]) for n in batch}
