"""Where a model runs and in what precision: training (`train.device`, `train.precision`),
index builds (`--device`) and the service (`HCLIP_DEVICE`)."""

from __future__ import annotations

from typing import Any

import torch

from models.config import ConfigError


def resolve_device(name: str, field: str = "train.device") -> torch.device:
    """auto: CUDA when torch sees a GPU, else the CPU. Asking for CUDA without one is a
    configuration mistake, reported as one (naming `field`) rather than as a crash later."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{field}: 'cuda' was asked for, but torch {torch.__version__} sees no CUDA "
            "device (torch.cuda.is_available() is False); use 'auto' or 'cpu'"
        )
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"{field}: expected auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def autocast_dtype(
    precision: str, device: torch.device, field: str = "train.precision"
) -> torch.dtype | None:
    """bf16 autocast for the encoders, or None for plain fp32.

    auto: bf16 on a GPU that supports it; fp32 on the CPU, where bf16 matmuls are no faster
    on most machines and results would drift from fp32 runs for no gain.
    """
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device.type == "cuda" and not cuda_bf16:
            raise ConfigError(f"{field}: this GPU does not support bf16; use 'fp32'")
        return torch.bfloat16
    return torch.bfloat16 if cuda_bf16 else None


def to_device(x: Any, device: torch.device) -> Any:
    """A batch of features (a tensor, a tower's keyword inputs, or groups of them: a fine-tuned
    audio tower's AudioGroups) on `device`."""
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(to_device(v, device) for v in x)
    return x.to(device, non_blocking=True)
