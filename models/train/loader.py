"""The training DataLoader: one item is one batch, read, decoded and featurized in a worker.

The trainer decides the batches (a seeded permutation per epoch) and hands them to the loader
through `EpochBatches`; the loader never shuffles, so the data order depends on the seed alone
and 0 or N workers train the same model. A worker returns the frozen featurizers' output
(MiniLM for text, a plugin's tower; models.encoders) and the duplicate-detection keys, so the
training process only runs the trainable layers. The exception: with an accelerator, frozen
pretrained towers run in the training process on it (`towers_run_in_workers`); a worker then
sends what the feature cache holds and the decoded inputs of the rest (PendingFeatures).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from models.config import ModelConfig
from models.encoders import Featurizer, featurizer
from models.encoders.tower_files import identity
from models.records import RecordError
from models.train.data import TupleSource
from models.train.feature_cache import (
    CachedFeatures,
    FeatureStore,
    cache_root,
    gather,
    tower_key,
)


def towers_run_in_workers(device: torch.device) -> bool:
    """Where frozen pretrained towers run in training: in the DataLoader workers on the CPU;
    with an accelerator, in the training process on it (one GPU outruns any number of CPU
    workers, and workers must not initialise CUDA)."""
    return device.type == "cpu"


class BatchReader(Dataset[dict[str, Any]]):
    """`reader[indices]` -> {"features": {name: (B, ...)}, "keys": {name: (B,)}}; a frozen
    tower that runs in the training process gives a PendingFeatures instead of (B, H)."""

    def __init__(self, source: TupleSource, cfg: ModelConfig, towers_in_workers: bool = True):
        self.source = source
        self.featurizers: dict[str, Featurizer] = {
            n: featurizer(cfg.modalities[n]) for n in cfg.names
        }
        # Frozen pretrained towers: their features come from the cache once computed.
        self.cached: dict[str, CachedFeatures] = {}
        self.deferred: dict[str, FeatureStore | None] = {}  # towers run by the trainer
        root = cache_root()
        for n in cfg.names:
            m = cfg.modalities[n]
            if m.kind != "transformers" or m.train_layers != 0:
                continue
            assert m.model is not None
            store = None if root is None else root / tower_key(identity(m.model), m.pooling)
            if not towers_in_workers:
                self.deferred[n] = None if store is None else FeatureStore(store)
            elif store is not None:
                self.cached[n] = CachedFeatures(self.featurizers[n], store)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: list[int]) -> dict[str, Any]:
        try:
            items, keys = self.source.batch(index)
        except RecordError as exc:
            # Raised in a worker it would reach the trainer inside a worker traceback; returned,
            # the trainer raises it as the plain "line N, id X: ..." a user reads.
            return {"error": str(exc)}
        features: dict[str, Any] = {}
        for n, f in self.featurizers.items():
            if n in self.deferred:
                features[n] = gather(items[n], keys[n], self.deferred[n])
            elif n in self.cached:
                features[n] = self.cached[n](items[n], keys[n])
            else:
                features[n] = f(items[n])
        return {"features": features, "keys": keys}


class EpochBatches(Sampler[list[int]]):
    """The batches of the current epoch, set by the trainer before each pass."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def make_loader(
    reader: BatchReader, batches: EpochBatches, workers: int, pin_memory: bool
) -> DataLoader[dict[str, Any]]:
    return DataLoader(
        reader,
        batch_size=None,  # each index the sampler yields is already a batch
        sampler=batches,
        num_workers=workers,
        # Workers live across epochs, and so do their caches (MiniLM's sentence cache).
        persistent_workers=workers > 0,
        pin_memory=pin_memory,
        # Its own generator: creating an iterator must not draw from the global RNG.
        generator=torch.Generator(),
    )
