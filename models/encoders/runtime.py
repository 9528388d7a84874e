"""Which runtime computes the frozen pretrained towers: torch, or ONNX Runtime in fp32 or
dynamic int8 (models.encoders.onnx_runtime), chosen by the service's HCLIP_ENCODER_RUNTIME."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Runtime:
    """`name`: torch, onnx or onnx-int8; ONNX graphs are kept in `cache_dir` (the service:
    `<model dir>/onnx`), and a session computes on `threads` threads (the service's encode
    threads)."""

    name: str = "torch"
    cache_dir: Path | None = None
    threads: int = 1

    @property
    def onnx(self) -> bool:
        return self.name != "torch"


TORCH = Runtime()
