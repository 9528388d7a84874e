"""Featurizers: the frozen, CPU-side first stage of an encoder, from decoded items to a batch.

For most kinds this only stacks tensors. For `text` it runs the frozen MiniLM and for `plugin`
the plugin's frozen tower. Nothing here trains, so training runs it where records are read and
decoded (the DataLoader's worker processes), apart from the trainable layers that follow on the
training device; the service and the indexer run it through Encoder.collate. Featurizers are
picklable and load their frozen weights at most once per process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from models.config import ModalityConfig
from models.plugins import load_tower, plugin
from models.text_backbone import shared_backbone

Featurizer = Callable[[list[Any]], torch.Tensor]


def stack(items: list[Any]) -> torch.Tensor:
    return torch.stack(items)  # (B, ...)


class TextFeatures:
    """Sentences -> (B, 384) MiniLM embeddings, cached per sentence in each process."""

    def __call__(self, items: list[Any]) -> torch.Tensor:
        return shared_backbone().embed(list(items))  # (B, 384)


class PluginFeatures:
    """Decoded items -> (B, feature_dim) outputs of a plugin's frozen tower."""

    def __init__(self, cfg: ModalityConfig):
        assert cfg.plugin is not None
        self.cfg = cfg
        self.plugin = plugin(cfg.plugin)
        self.dim = self.plugin.feature_dim(cfg.options)
        # Loaded now, so that a missing or mismatched weights file fails when the model is built
        # (naming the file), not at the first request.
        self.tower = load_tower(cfg)

    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg}  # a spawned worker loads the tower itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"])  # type: ignore[misc]

    @torch.no_grad()
    def __call__(self, items: list[Any]) -> torch.Tensor:
        x = self.plugin.collate(list(items))
        out = self.tower(x)  # (B, feature_dim)
        if out.shape != (len(items), self.dim):
            raise RuntimeError(
                f"plugin {self.cfg.plugin!r}: the tower returned shape {tuple(out.shape)} for "
                f"{len(items)} inputs, feature_dim says ({len(items)}, {self.dim})"
            )
        return out.float()


def build_featurizer(cfg: ModalityConfig) -> Featurizer:
    if cfg.kind == "text":
        return TextFeatures()
    if cfg.kind == "plugin":
        return PluginFeatures(cfg)
    return stack
