"""The training loop: seeded, resumable, with a progress bar and an InfoNCE MI readout.

Batches come from a DataLoader (models.train.loader) whose workers read, decode and featurize the
records (frozen pretrained towers run here instead, on `train.device`, when it is an
accelerator); the trainable layers run on `train.device`, the encoders under bf16 autocast where
`train.precision` allows it, the heads and losses in fp32. The data order depends on the seed
alone (one permutation per epoch), never on the number of workers. With a negatives queue, an
EMA copy of the encoders (MoCo's momentum encoder) encodes the candidates' side. A resumed run
restores the model, the optimiser, the queue, the momentum encoders and the RNG, replays the
permutations to find its place, and ends where an uninterrupted run ends.
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from models.checkpoint import CheckpointError, build_model
from models.config import RESUMABLE_CHANGES, ModelConfig, TrainConfig
from models.device import autocast_dtype, resolve_device, to_device
from models.encoders.pretrained import PretrainedFeatures
from models.model import MultimodalModel
from models.progress import Progress
from models.records import RecordError
from models.tensor_files import check_tensors
from models.train.checkpoints import (
    CheckpointStore,
    load_optimizer_state,
    load_rng_state,
    optimizer_state,
    rng_state,
    under_prefix,
    with_prefix,
)
from models.train.data import TupleSource
from models.train.feature_cache import FeatureStore, complete
from models.train.loader import BatchReader, EpochBatches, make_loader, towers_run_in_workers
from models.train.losses import LossOutput, build_loss
from models.train.queue import NegativesQueue

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


def run_identity(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint and the run resuming it must agree on."""
    train = {k: v for k, v in asdict(train_cfg).items() if k not in RESUMABLE_CHANGES}
    return {"model": model_cfg.to_dict(), "train": train}


def _first_difference(saved: Any, now: Any, path: str = "") -> str | None:
    if isinstance(saved, dict) and isinstance(now, dict):
        for key in sorted(set(saved) | set(now)):
            found = _first_difference(saved.get(key), now.get(key), f"{path}{key}.")
            if found:
                return found
        return None
    if saved != now:
        return f"{path.rstrip('.')}: the checkpoint's run has {saved!r}, this config {now!r}"
    return None


class Trainer:
    """One training run. `steps()` trains and yields after every optimiser step."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        data: TupleSource,
        progress: bool = True,
        checkpoints: CheckpointStore | None = None,
        resume: bool = False,
    ):
        if train_cfg.num_threads:
            torch.set_num_threads(train_cfg.num_threads)
        self.model_cfg, self.cfg, self.data = model_cfg, train_cfg, data
        self.progress, self.checkpoints = progress, checkpoints
        self.device = resolve_device(train_cfg.device)
        self.amp = autocast_dtype(train_cfg.precision, self.device)
        seed_everything(train_cfg.seed)
        self.model = build_model(model_cfg).to(self.device)
        self.model_cfg = self.model.cfg  # plugin options completed (models.plugins)
        self.loss_fn = build_loss(train_cfg.loss)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.n = len(data)
        self.bs = min(train_cfg.batch_size, self.n)
        if self.bs < 2:
            raise RecordError(f"training needs at least 2 records, got {self.n}")
        # The ragged last batch is dropped: contrastive losses need full batches.
        self.steps_per_epoch = self.n // self.bs
        self.total = self.steps_per_epoch * train_cfg.epochs
        self.queue: NegativesQueue | None = None
        self.momentum: nn.ModuleDict | None = None
        if train_cfg.queue_size:
            names, d = model_cfg.names, model_cfg.latent_dim
            self.queue = NegativesQueue(train_cfg.queue_size, names, d, self.device)
            # Starts equal to the encoders and trails them (models.train.losses says why).
            self.momentum = copy.deepcopy(self.model.encoders).requires_grad_(False)
        self.step = 0
        self.towers: dict[str, tuple[PretrainedFeatures, FeatureStore | None]] = {}
        self.history: list[dict[str, float]] = []
        self._bar: Progress | None = None
        if checkpoints is not None:
            checkpoints.remove_partial()
        if resume:
            self._restore()

    def result(self) -> TrainResult:
        return TrainResult(model=self.model, history=self.history)

    def steps(self) -> Generator[int, None, None]:
        batches = EpochBatches()
        in_workers = towers_run_in_workers(self.device)
        reader = BatchReader(self.data, self.model_cfg, towers_in_workers=in_workers)
        # The frozen towers the workers leave to this process: each on the training device.
        self.towers.clear()
        for n, store in reader.deferred.items():
            tower = reader.featurizers[n]
            assert isinstance(tower, PretrainedFeatures)
            tower.place(self.device, self.amp)
            self.towers[n] = (tower, store)
        loader = make_loader(
            reader,
            batches,
            self.cfg.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        order_gen = torch.Generator().manual_seed(self.cfg.seed)
        self._bar = bar = Progress(
            total=self.total,
            initial=self.step,
            desc=f"train {self.model_cfg.head}",
            unit="step",
            disable=not self.progress,
        )
        self.model.train()
        try:
            for epoch in range(self.cfg.epochs):
                # Drawn for every epoch, finished ones included: a resumed run replays the
                # permutations to reach the order an uninterrupted run would see.
                order = torch.randperm(self.n, generator=order_gen).tolist()
                done = self.step - epoch * self.steps_per_epoch
                if done >= self.steps_per_epoch:
                    continue
                batches.batches = [
                    order[b * self.bs : (b + 1) * self.bs]
                    for b in range(max(0, done), self.steps_per_epoch)
                ]
                for batch in loader:
                    self._train_step(batch, epoch)
                    bar.update(1)
                    yield self.step
        finally:
            bar.close()
            del loader  # persistent workers end with it
        self.model.eval()
        self.model.to("cpu")  # what callers save, evaluate and serve

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.amp is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp)

    def _train_step(self, batch: dict[str, Any], epoch: int) -> None:
        if "error" in batch:
            raise RecordError(batch["error"])
        features = {
            n: to_device(complete(x, *self.towers[n]) if n in self.towers else x, self.device)
            for n, x in batch["features"].items()
        }
        keys = {n: k.to(self.device, non_blocking=True) for n, k in batch["keys"].items()}
        for group in self.opt.param_groups:
            group["lr"] = _lr_at(self.step, self.total, self.cfg.lr)
        with self._autocast():
            embs = self.model(features)
            targets = self._momentum_embeddings(features)
        # Products of m unit vectors and logits scaled up to 100 need fp32's mantissa.
        embs = {n: e.float() for n, e in embs.items()}  # (B, d) each
        if targets is not None:
            targets = {n: e.float() for n, e in targets.items()}  # (B, d) each
        out: LossOutput = self.loss_fn(
            self.model.head, embs, keys, queue=self.queue, targets=targets
        )
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        self.opt.step()
        self.model.head.clamp_()
        if self.queue is not None and targets is not None:
            self._update_momentum()
            self.queue.push(targets, keys)
        self.step += 1
        if self.step % self.cfg.log_every == 0 or self.step == self.total:
            self._log(out, epoch)
        every = self.cfg.checkpoint_every
        # No checkpoint after the last step: the caller saves the finished model.
        due = every > 0 and self.step % every == 0 and self.step < self.total
        if due and self.checkpoints is not None:
            self._save()

    @torch.no_grad()
    def _momentum_embeddings(
        self, features: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """The candidates' side of the batch, by the momentum encoders (with a queue only)."""
        if self.momentum is None:
            return None
        return {n: self.momentum[n](x) for n, x in features.items()}  # (B, d) each

    @torch.no_grad()
    def _update_momentum(self) -> None:
        assert self.momentum is not None
        m = self.cfg.queue_momentum
        online = self.model.encoders.parameters()
        for slow, fast in zip(self.momentum.parameters(), online, strict=True):
            slow.mul_(m).add_(fast.detach(), alpha=1.0 - m)

    def _log(self, out: LossOutput, epoch: int) -> None:
        row = {
            "step": float(self.step),
            "epoch": float(epoch + 1),
            "loss": float(out.loss.detach()),
            "mi_bound_bits": out.mi_bound_bits,
            "ceiling_bits": out.ceiling_bits,
            "logit_scale": float(self.model.head.scale.detach()),
        }
        self.history.append(row)
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{row['loss']:.3f}",
                mi=f"{row['mi_bound_bits']:.2f}/{row['ceiling_bits']:.2f} bits",
            )
        log.info(
            "step %d/%d loss %.4f MI >= %.2f bits (ceiling log2(batch + queue) = %.2f)",
            self.step,
            self.total,
            row["loss"],
            row["mi_bound_bits"],
            row["ceiling_bits"],
        )

    def _save(self) -> None:
        assert self.checkpoints is not None
        opt_tensors, groups = optimizer_state(self.opt)
        tensors = with_prefix("model", self.model.state_dict())
        tensors |= with_prefix("optim", opt_tensors) | with_prefix("rng", rng_state())
        meta: dict[str, Any] = {
            "run": run_identity(self.model_cfg, self.cfg),
            "history": self.history,
            "optim_groups": groups,
        }
        if self.queue is not None and self.momentum is not None:
            queue_tensors, meta["queue"] = self.queue.state()
            tensors |= with_prefix("queue", queue_tensors)
            tensors |= with_prefix("momentum", self.momentum.state_dict())
        path = self.checkpoints.save(self.step, tensors, meta)
        log.info("checkpoint at step %d: %s", self.step, path)

    def _restore(self) -> None:
        store = self.checkpoints
        path = store.latest() if store is not None else None
        if store is None or path is None:
            where = store.root if store is not None else "(no checkpoint directory)"
            raise CheckpointError(f"--resume: no checkpoint in {where} to resume from")
        tensors, state = store.load(path)
        differs = _first_difference(state["run"], run_identity(self.model_cfg, self.cfg))
        if differs:
            raise CheckpointError(f"--resume from {path}: {differs}")
        weights = under_prefix("model", tensors)
        check_tensors(path, weights, self.model.state_dict(), CheckpointError)
        self.model.load_state_dict(weights, strict=True)
        load_optimizer_state(self.opt, under_prefix("optim", tensors), state["optim_groups"])
        if self.queue is not None and self.momentum is not None:
            self.queue.load(under_prefix("queue", tensors), state["queue"])
            momentum = under_prefix("momentum", tensors)
            check_tensors(path, momentum, self.momentum.state_dict(), CheckpointError)
            self.momentum.load_state_dict(momentum, strict=True)
        load_rng_state(under_prefix("rng", tensors))
        self.step = int(state["step"])
        self.history = list(state["history"])
        log.info("resuming from step %d/%d (%s)", self.step, self.total, path)


def train_model(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    data: TupleSource,
    progress: bool = True,
    checkpoints: CheckpointStore | None = None,
    resume: bool = False,
) -> TrainResult:
    trainer = Trainer(model_cfg, train_cfg, data, progress, checkpoints, resume)
    for _ in trainer.steps():
        pass
    return trainer.result()
