"""Validation during training (`train.validation`): held-out retrieval and the InfoNCE bound.

At each validation point the held-out records (the first `max_records` of the file) are
embedded by the model being trained, through the same reader and forward pass as a training
batch; every view's retrieval figures come from models.evaluation (the model's own head, each
record's own tuple the positive), and the bound in bits from the training loss on held-out
batches of the training batch size. `train.keep: best` keeps the weights of the point with
the best mean hit@1 over views (models.train.trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ValidationConfig
from models.evaluation import all_views, mean_hit1, retrieval
from models.heads import Head
from models.records import RecordError
from models.train.loader import BatchReader

Embed = Callable[[dict[str, Any]], dict[str, torch.Tensor]]  # a reader's batch -> (B, d) each


class Validator:
    def __init__(
        self,
        cfg: ValidationConfig,
        reader: BatchReader,
        batch_size: int,
        loss_fn: nn.Module,
        steps_per_epoch: int,
        total_steps: int,
    ):
        self.cfg, self.reader, self.loss_fn = cfg, reader, loss_fn
        n = len(reader) if not cfg.max_records else min(cfg.max_records, len(reader))
        self.n = n
        self.batch_size = min(batch_size, n)
        self.every = cfg.every * (steps_per_epoch if cfg.unit == "epochs" else 1)
        self.total_steps = total_steps

    def due(self, step: int) -> bool:
        """After every `every` epochs or steps, and after the last step."""
        return step % self.every == 0 or step == self.total_steps

    @torch.no_grad()
    def run(self, head: Head, embed: Embed) -> dict[str, Any]:
        """{"mi_bound_bits", "ceiling_bits", "mean_hit@1", "views": {view: figures}}."""
        parts: dict[str, list[torch.Tensor]] = {}
        bounds, ceilings = [], []
        for start in range(0, self.n, self.batch_size):
            index = list(range(start, min(start + self.batch_size, self.n)))
            batch = self.reader[index]
            if "error" in batch:
                raise RecordError(batch["error"])
            embs = embed(batch["features"])
            if len(index) == self.batch_size:  # the bound of full batches: one ceiling
                device = next(iter(embs.values())).device
                keys = {n: k.to(device) for n, k in batch["keys"].items()}
                out = self.loss_fn(head, embs, keys)
                bounds.append(out.mi_bound_bits)
                ceilings.append(out.ceiling_bits)
            for name, e in embs.items():
                parts.setdefault(name, []).append(e)
        embs = {name: torch.cat(p) for name, p in parts.items()}  # (n, d) each
        views = retrieval(head, embs, all_views(head.names), self.cfg.candidates or None)
        return {
            "mi_bound_bits": float(np.mean(bounds)),
            "ceiling_bits": float(np.mean(ceilings)),
            "mean_hit@1": mean_hit1(views),
            "views": views,
        }
