"""The training loop: seeded, resumable, with a progress bar and an InfoNCE MI readout.

Batches come from a DataLoader (models.train.loader) whose workers read, decode and featurize the
records (frozen pretrained towers run here instead, on `train.device`, when it is an
accelerator); the trainable layers run on `train.device`, the encoders under bf16 autocast where
`train.precision` allows it, the heads and losses in fp32. The data order depends on the seed
alone (one permutation per epoch), never on the number of workers. With a negatives queue, an
EMA copy of the encoders (MoCo's momentum encoder) encodes the candidates' side. A resumed run
restores the model, the optimiser, the queue, the momentum encoders and the RNG, replays the
permutations to find its place, and ends where an uninterrupted run ends.

With `train.validation` the run evaluates held-out retrieval at its validation points
(models.train.validation) and, with `train.keep: best`, ends with the weights of the best one;
with `train.log_dir` it writes TensorBoard event files and JSON Lines (models.train.experiment_log).
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
from models.train.experiment_log import ExperimentLog
from models.train.feature_cache import FeatureStore, complete
from models.train.loader import BatchReader, EpochBatches, make_loader, towers_run_in_workers
from models.train.losses import LossOutput, build_loss
from models.train.queue import NegativesQueue
from models.train.validation import Validator

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainResult:
    model: MultimodalModel
    history: list[dict[str, float]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)  # one row per point
    kept: dict[str, Any] | None = None  # the point whose weights the model holds (keep: best)

    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        return {"steps": int(last.get("step", 0)), "final": last}

    def metrics_rows(self) -> list[dict[str, Any]]:
        """Training and validation rows in step order: the model directory's metrics.jsonl."""
        rows = [{"kind": "train", **r} for r in self.history] + self.validation
        return sorted(rows, key=lambda r: (r["step"], r["kind"] == "validation"))


def _lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 5% of the base rate."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# Settings newer than some checkpoints: left out of a run's identity at their defaults, so
# that such a checkpoint still resumes.
LATER_DEFAULTS: dict[str, Any] = {"validation": None, "keep": "last"}


def run_identity(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint and the run resuming it must agree on."""
    train = {
        k: v
        for k, v in asdict(train_cfg).items()
        if k not in RESUMABLE_CHANGES and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])
    }
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
        validation: TupleSource | None = None,
        log_dir: Path | None = None,
    ):
        """`validation`: the held-out records of `train_cfg.validation`; `log_dir`: where the
        experiment logs go (train.log_dir, resolved)."""
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
        self.validation_data = validation
        if (validation is None) != (train_cfg.validation is None):
            raise ValueError("train.validation and the validation records go together")
        self.validator: Validator | None = None
        self.validations: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        # Opened now: a missing tensorboard stops the run before it trains.
        self.log = ExperimentLog(log_dir) if log_dir is not None else None
        if checkpoints is not None:
            checkpoints.remove_partial()
        if resume:
            self._restore()

    def result(self) -> TrainResult:
        kept = self.best if self.cfg.keep == "best" else None
        if kept is None and self.validations:
            kept = self.validations[-1]
        return TrainResult(self.model, self.history, self.validations, kept)

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
        if self.validation_data is not None:
            assert self.cfg.validation is not None
            self.validator = Validator(
                self.cfg.validation,
                BatchReader(self.validation_data, self.model_cfg, towers_in_workers=in_workers),
                self.bs,
                self.loss_fn,
                self.steps_per_epoch,
                self.total,
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
            if self.log is not None:
                self.log.close()
        if self.cfg.keep == "best" and self.best_state is not None:
            self.model.load_state_dict(self.best_state)
            assert self.best is not None
            log.info("kept the weights of step %d (validation)", self.best["step"])
        self.model.eval()
        self.model.to("cpu")  # what callers save, evaluate and serve

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.amp is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp)

    def _features(self, batch_features: dict[str, Any]) -> dict[str, Any]:
        """A reader's features on the training device, frozen towers' features completed."""
        return {
            n: to_device(complete(x, *self.towers[n]) if n in self.towers else x, self.device)
            for n, x in batch_features.items()
        }

    def _embed(self, batch_features: dict[str, Any]) -> dict[str, torch.Tensor]:
        """(B, d) fp32 embeddings per modality, as a training step computes them."""
        with self._autocast():
            embs = self.model(self._features(batch_features))
        return {n: e.float() for n, e in embs.items()}  # (B, d) each

    def _train_step(self, batch: dict[str, Any], epoch: int) -> None:
        if "error" in batch:
            raise RecordError(batch["error"])
        features = self._features(batch["features"])
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
        if self.validator is not None and self.validator.due(self.step):
            self._validate()
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
            "lr": float(self.opt.param_groups[0]["lr"]),
        }
        self.history.append(row)
        if self.log is not None:
            self.log.write({"kind": "train", **row})
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

    def _validate(self) -> None:
        assert self.validator is not None
        self.model.eval()
        try:
            figures = self.validator.run(self.model.head, self._embed)
        finally:
            self.model.train()
        epoch = round(self.step / self.steps_per_epoch, 3)
        row: dict[str, Any] = {"kind": "validation", "step": self.step, "epoch": epoch, **figures}
        self.validations.append(row)
        if self.best is None or row["mean_hit@1"] > self.best["mean_hit@1"]:
            self.best = row
            if self.cfg.keep == "best":
                state = self.model.state_dict()
                self.best_state = {k: v.detach().cpu().clone() for k, v in state.items()}
        if self.log is not None:
            self.log.write(row)
        log.info(
            "validation at step %d (epoch %s): mean hit@1 %.3f, MI >= %.2f bits",
            self.step,
            epoch,
            row["mean_hit@1"],
            row["mi_bound_bits"],
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
            "validations": self.validations,
            "best": self.best,
        }
        if self.best_state is not None:
            tensors |= with_prefix("best", self.best_state)
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
        self.validations = list(state.get("validations", []))
        self.best = state.get("best")
        best = under_prefix("best", tensors)
        self.best_state = best or None
        log.info("resuming from step %d/%d (%s)", self.step, self.total, path)


def train_model(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    data: TupleSource,
    progress: bool = True,
    checkpoints: CheckpointStore | None = None,
    resume: bool = False,
    validation: TupleSource | None = None,
    log_dir: Path | None = None,
) -> TrainResult:
    trainer = Trainer(
        model_cfg, train_cfg, data, progress, checkpoints, resume, validation, log_dir
    )
    for _ in trainer.steps():
        pass
    return trainer.result()
