"""The training loop: seeded, with a progress bar and an InfoNCE mutual-information readout."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from models.config import ModelConfig, TrainConfig
from models.data import TupleDataset
from models.losses import LossOutput, build_loss
from models.model import MultimodalModel

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainResult:
    model: MultimodalModel
    history: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        return {"steps": int(last.get("step", 0)), "final": last}


def _lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 5% of the base rate."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_model(
    model_cfg: ModelConfig, train_cfg: TrainConfig, data: TupleDataset, progress: bool = True
) -> TrainResult:
    if train_cfg.num_threads:
        torch.set_num_threads(train_cfg.num_threads)
    seed_everything(train_cfg.seed)
    model = MultimodalModel(model_cfg)
    loss_fn = build_loss(train_cfg.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    n = len(data)
    bs = min(train_cfg.batch_size, n)
    if bs < 2:
        raise ValueError(f"training needs at least 2 records, got {n}")
    steps_per_epoch = n // bs  # drop the ragged last batch: contrastive losses need full batches
    total = steps_per_epoch * train_cfg.epochs
    gen = torch.Generator().manual_seed(train_cfg.seed)
    result = TrainResult(model=model)
    bar = tqdm(total=total, desc=f"train {model_cfg.head}", unit="step", disable=not progress)
    step = 0
    model.train()
    for epoch in range(train_cfg.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for b in range(steps_per_epoch):
            items, keys = data.batch(order[b * bs : (b + 1) * bs])
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, total, train_cfg.lr)
            batch = {name: model.encoder(name).collate(v) for name, v in items.items()}
            out: LossOutput = loss_fn(model.head, model(batch), keys)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            model.head.clamp_()
            step += 1
            bar.update(1)
            if step % train_cfg.log_every == 0 or step == total:
                row = {
                    "step": float(step),
                    "epoch": float(epoch + 1),
                    "loss": float(out.loss.detach()),
                    "mi_bound_bits": out.mi_bound_bits,
                    "ceiling_bits": out.ceiling_bits,
                    "logit_scale": float(model.head.scale.detach()),
                }
                result.history.append(row)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}",
                    mi=f"{row['mi_bound_bits']:.2f}/{row['ceiling_bits']:.2f} bits",
                )
                log.info(
                    "step %d/%d loss %.4f MI >= %.2f bits (ceiling log2 N = %.2f)",
                    step,
                    total,
                    row["loss"],
                    row["mi_bound_bits"],
                    row["ceiling_bits"],
                )
    bar.close()
    model.eval()
    return result
