"""An example encoder plugin: a frozen linear tower over small greyscale images.

It is what a package would ship (docs/models.md shows its pyproject entry point). The tests
install it for real: they copy this module beside a `*.dist-info` whose entry_points.txt names
it in the group `hclip.encoders`, and put that directory on sys.path and PYTHONPATH.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from models.config import ConfigError
from models.inputs import InputError, InputLimits, read_media
from models.plugins import TowerPlugin

DEFAULTS = {"size": 8, "features": 16}


class ToyPixels(TowerPlugin):
    """Options: `size` (images are resized to size x size), `features` (the tower's width)."""

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown option (known: {', '.join(DEFAULTS)})")
        out = DEFAULTS | options
        for key, value in out.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
        return out

    def feature_dim(self, options: Mapping[str, Any]) -> int:
        return int(options["features"])

    def decode(
        self, value: Any, options: Mapping[str, Any], base_dir: Path | None, limits: InputLimits
    ) -> torch.Tensor:
        data = read_media(value, base_dir, "image", limits)
        size = int(options["size"])
        try:
            with Image.open(io.BytesIO(data)) as img:
                grey = img.convert("L").resize((size, size), Image.Resampling.BILINEAR)
                arr = np.asarray(grey, dtype=np.float32) / 255.0
        except Exception:
            raise InputError("image could not be decoded") from None
        return torch.from_numpy(arr.reshape(-1))  # (size * size,)

    def build_tower(self, options: Mapping[str, Any]) -> nn.Module:
        size, features = int(options["size"]), int(options["features"])
        return nn.Sequential(nn.Linear(size * size, features), nn.Tanh())
