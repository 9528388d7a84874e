"""Where training runs (`train.device`) and in what precision (`train.precision`)."""

from __future__ import annotations

import torch

from models.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """auto: CUDA when torch sees a GPU, else the CPU. Asking for CUDA without one is a
    configuration mistake, reported as one rather than as a crash in the first step."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device: 'cuda' was asked for, but torch {torch.__version__} sees no CUDA "
            "device (torch.cuda.is_available() is False); use 'auto' or 'cpu'"
        )
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast for the encoders, or None for plain fp32.

    auto: bf16 on a GPU that supports it; fp32 on the CPU, where bf16 matmuls are no faster
    on most machines and results would drift from fp32 runs for no gain.
    """
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device.type == "cuda" and not cuda_bf16:
            raise ConfigError("train.precision: this GPU does not support bf16; use 'fp32'")
        return torch.bfloat16
    return torch.bfloat16 if cuda_bf16 else None
