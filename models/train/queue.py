"""A queue of negatives from earlier batches (MoCo-style) for the full-conditional loss.

InfoNCE cannot certify more than log N bits with N candidates, and with one batch N is the batch
size. The queue keeps the last `size` training tuples' per-modality embeddings g_i, detached,
with each tuple's input keys, so that every target can be told apart from batch + queue
candidates. The loss forms each target-side product (the record factor of any target set) from
the queued embeddings; no head's record factor has parameters, so this is the same as queueing
the products themselves, and one queue of m embeddings serves all 2m directions of the loss.

The queued embeddings come from a momentum encoder (an exponential moving average of the
encoders, `train.queue_momentum`), as in MoCo: entries made by the online encoders themselves
differ from the batch's by the encoders' drift between steps, and the model learns to tell
queued candidates from fresh ones by that drift alone (measured: the loss stayed at
ln(batch + queue), the softmax never left uniform). models/train/trainer.py keeps the momentum
copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class NegativesQueue:
    """A ring buffer of (embeddings, input keys) per modality, oldest overwritten first."""

    def __init__(
        self,
        size: int,
        names: Sequence[str],
        dim: int,
        device: torch.device | str | None = None,
    ):
        if size < 1:
            raise ValueError(f"queue size must be >= 1, got {size}")
        self.size = size
        self.embs = {n: torch.zeros(size, dim, device=device) for n in names}  # (K, d)
        self.keys = {n: torch.zeros(size, dtype=torch.int64, device=device) for n in names}  # (K,)
        self.ptr = 0  # next slot to write
        self.filled = 0

    def __len__(self) -> int:
        return self.filled

    def entries(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The filled part: slots [0, filled) until the ring first wraps, then all of it."""
        k = self.filled
        return (
            {n: e[:k] for n, e in self.embs.items()},  # (k, d) each
            {n: v[:k] for n, v in self.keys.items()},  # (k,) each
        )

    @torch.no_grad()
    def push(self, embs: Mapping[str, torch.Tensor], keys: Mapping[str, torch.Tensor]) -> None:
        """Append a batch's embeddings and keys; a batch larger than the queue keeps its tail."""
        n = next(iter(embs.values())).shape[0]
        start = max(0, n - self.size)
        device = next(iter(self.embs.values())).device
        slots = (self.ptr + torch.arange(n - start, device=device)) % self.size  # (n',)
        for name in self.embs:
            self.embs[name][slots] = embs[name][start:].detach().to(self.embs[name].dtype)
            self.keys[name][slots] = keys[name][start:].to(device)
        self.ptr = (self.ptr + n - start) % self.size
        self.filled = min(self.size, self.filled + n - start)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, metadata) for a training checkpoint."""
        tensors = {f"embs.{n}": e for n, e in self.embs.items()}
        tensors |= {f"keys.{n}": k for n, k in self.keys.items()}
        return tensors, {"size": self.size, "ptr": self.ptr, "filled": self.filled}

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        if meta["size"] != self.size:
            raise ValueError(f"checkpoint queue holds {meta['size']} entries, config {self.size}")
        for name in self.embs:
            self.embs[name].copy_(tensors[f"embs.{name}"])
            self.keys[name].copy_(tensors[f"keys.{name}"])
        self.ptr = int(meta["ptr"])
        self.filled = int(meta["filled"])
