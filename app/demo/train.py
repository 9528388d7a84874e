"""Training one of the demo's models: a recipe stage for one head, on fresh tuples.

Runs in its own process (app/demo/pipeline.py starts one per head), so it sets up torch itself:
a fixed thread count and deterministic algorithms, so that a seed gives the same model on the
same machine.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from app.demo.data import build_media
from app.demo.recipe import Recipe, Stage, model_config, train_config
from app.demo.tuples import FreshTuples, media_pools
from models.checkpoint import load_model, save_model
from models.config import ModelConfig, TrainConfig
from models.model import MultimodalModel
from models.train.trainer import Trainer, TrainResult

REPORT_EVERY = 10  # steps between progress reports to the parent process

log = logging.getLogger(__name__)


def model_dir(data: Path, dataset: str, head: str) -> Path:
    return data / dataset / f"model-{head}"


def tuple_seed(seed: int, dataset: str) -> int:
    """The tuples' seed: its own stream per dataset, so that the shared and the interaction
    models never draw the same rows."""
    return seed * 1_000 + zlib.crc32(dataset.encode()) % 1_000


@contextmanager
def reproducible(threads: int) -> Iterator[None]:
    """A fixed thread count (a reduction's order depends on it) and torch's deterministic
    algorithms, restored afterwards for whatever else runs in this process."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


def freeze_convolutions(model: MultimodalModel) -> None:
    """Keep every convolution's weights: without gradients, autograd stops below the first
    trainable layer and the optimiser skips them (AdamW passes over parameters whose grad is
    None), so the frozen part costs a forward pass only."""
    for module in model.encoders.modules():
        if isinstance(module, nn.Conv2d):
            module.requires_grad_(False)


def train_stage(
    data: Path,
    recipe: Recipe,
    stage: Stage,
    head: str,
    seed: int,
    progress: bool,
    report: Callable[[int], None] | None = None,
) -> Path:
    """Train `head` on `stage` (its encoders from the warm-start model, if any) and save it.
    `report(n)` is called with every REPORT_EVERY steps done."""
    out = model_dir(data, stage.dataset, head)
    if (out / "model.safetensors").exists():
        return out
    with reproducible(recipe.threads):
        result = _train(data, recipe, stage, head, seed, progress, report)
    extra = {
        "train": train_config(recipe, stage, seed),
        "training": result.summary(),
        "recipe": recipe.to_dict(),
    }
    return save_model(result.model, out, extra=extra, overwrite=True)


def _train(
    data: Path,
    recipe: Recipe,
    stage: Stage,
    head: str,
    seed: int,
    progress: bool,
    report: Callable[[int], None] | None,
) -> TrainResult:
    cfg = ModelConfig.from_dict(model_config(recipe, head))
    train = TrainConfig.from_dict(train_config(recipe, stage, seed))
    pools = media_pools(build_media(data), "train", cfg, data)
    tuples = FreshTuples(
        pools,
        stage.dataset,
        stage.steps * recipe.batch_size,
        tuple_seed(seed, stage.dataset),
        recipe.speed_jitter,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, train, tuples, progress=progress)
    if stage.warm_start is not None:
        start = load_model(model_dir(data, stage.warm_start, head))
        trainer.model.encoders.load_state_dict(start.encoders.state_dict())
    if stage.freeze_convs:
        freeze_convolutions(trainer.model)
    reported = 0
    for step in trainer.steps():
        if report is not None and (step - reported >= REPORT_EVERY or step == stage.steps):
            report(step - reported)
            reported = step
    log.info(
        "trained %s on %s in %.0f s (%d steps)",
        head,
        stage.dataset,
        time.perf_counter() - t0,
        stage.steps,
    )
    return trainer.result()
