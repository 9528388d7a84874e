"""`hclip train --config CONFIG --out MODEL_DIR [--resume]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from models.config import ConfigError, RunConfig
from models.errors import CheckpointError, PluginError, PretrainedError
from models.extras import ExtraMissing
from models.records import RecordError, display_path

if TYPE_CHECKING:
    from models.train.checkpoints import CheckpointStore
    from models.train.records_file import RecordsFile
    from models.train.trainer import TrainResult

log = logging.getLogger(__name__)
# The trainer (torch) is imported by run(): help and argument errors answer at once.

USER_ERRORS = (
    ConfigError,
    RecordError,
    CheckpointError,
    PluginError,
    PretrainedError,
    ExtraMissing,
)
VALIDATION_FILE = "validation.json"  # beside the model: the kept point and every point's figures
METRICS_FILE = "metrics.jsonl"  # beside the model: the run's logged rows, training and validation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="training config (JSON)")
    p.add_argument("--out", required=True, type=Path, help="model directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint that train.checkpoint_every wrote",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="where checkpoints go (default: OUT.checkpoints beside --out; removed on success)",
    )


def _checkpoints(args: argparse.Namespace, every: int) -> CheckpointStore | None:
    """The run's checkpoint store, after refusing to mix two runs' checkpoints."""
    from models.train.checkpoints import CheckpointStore, default_checkpoint_dir

    store = CheckpointStore(args.checkpoint_dir or default_checkpoint_dir(args.out))
    if store.root.resolve().is_relative_to(args.out.resolve()):
        raise CheckpointError(
            f"--checkpoint-dir {store.root}: must lie outside --out, which receives only the "
            "finished model"
        )
    if args.resume:
        if store.latest() is None:
            raise CheckpointError(f"--resume: no checkpoint in {store.root} to resume from")
        return store
    if store.latest() is not None:
        if not args.overwrite:
            raise CheckpointError(
                f"{store.root}: holds checkpoints of an earlier run; pass --resume to continue "
                "it or --overwrite to start afresh"
            )
        store.clear()
    return store if every else None


def _records(path: Path, cfg: RunConfig) -> RecordsFile:
    from models.train.records_file import RecordsFile

    try:
        return RecordsFile.scan(path, cfg.model, cfg.input_limits())
    except RecordError as exc:  # the one line names the file as every command does
        raise exc.in_file(display_path(path)) from None


def _beside_model(result: TrainResult, keep: str) -> dict[str, str]:
    """The files written into the model directory with it."""
    rows = result.metrics_rows()
    files = {METRICS_FILE: "".join(json.dumps(r) + "\n" for r in rows)}
    if result.validation:
        kept = {"keep": keep, "kept": result.kept, "points": result.validation}
        files[VALIDATION_FILE] = json.dumps(kept, indent=2) + "\n"
    return files


def run(args: argparse.Namespace) -> int:
    from models.checkpoint import prepare_out_dir, save_model
    from models.plugins import resolve_options
    from models.train.trainer import train_model

    cfg = RunConfig.load(args.config)
    # Plugins are looked up and their options completed before any record is decoded with them.
    cfg = replace(cfg, model=resolve_options(cfg.model))
    prepare_out_dir(args.out, args.overwrite)  # fail before the expensive part
    store = _checkpoints(args, cfg.train.checkpoint_every)
    log.info("indexing training records in %s", display_path(cfg.records_path))
    data = _records(cfg.records_path, cfg)
    held_out = None if cfg.validation_path is None else _records(cfg.validation_path, cfg)
    log.info(
        "%d training tuples, modalities %s, head %s", len(data), cfg.model.names, cfg.model.head
    )
    result = train_model(
        cfg.model,
        cfg.train,
        data,
        progress=not args.quiet,
        checkpoints=store,
        resume=args.resume,
        validation=held_out,
        log_dir=cfg.log_dir,
    )
    extra = {"train": cfg.to_dict()["train"], "training": result.summary()}
    files = _beside_model(result, cfg.train.keep)
    out = save_model(result.model, args.out, extra=extra, overwrite=args.overwrite, files=files)
    if store is not None:
        store.clear()  # the model is safely in place: nothing is left to resume
    print(f"model written to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hclip train", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except USER_ERRORS as exc:
        print(f"hclip train: error: {exc}", file=sys.stderr)
        return 2
