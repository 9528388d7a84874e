"""`plugin`: a tower from an installed package (models.plugins), frozen, followed by a
trainable MLP head. The plugin decodes its own inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.base import Featurizer, ProjectedEncoder
from models.limits import InputError, InputLimits
from models.plugins import PluginError, load_tower, plugin


def decode_plugin(
    value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits
) -> Any:
    assert cfg.plugin is not None
    try:
        found = plugin(cfg.plugin)
    except PluginError as exc:
        raise InputError(str(exc)) from None
    try:
        return found.decode(value, cfg.options, base_dir, limits)
    except InputError:
        raise
    except Exception as exc:  # someone else's decoder on untrusted input: one bad value
        raise InputError(
            f"plugin {cfg.plugin!r} could not decode the value ({type(exc).__name__}: {exc})"
        ) from None


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


class PluginEncoder(ProjectedEncoder):
    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg, cfg.hidden, latent_dim)
        features = PluginFeatures(cfg)
        self.featurizer = features  # (B, feature_dim)
        self.head = nn.Sequential(nn.Linear(features.dim, cfg.hidden), nn.GELU())

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_plugin(value, cfg, base_dir, limits)

    @staticmethod
    def featurizer_for(cfg: ModalityConfig) -> Featurizer:
        return PluginFeatures(cfg)

    def features(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch)
