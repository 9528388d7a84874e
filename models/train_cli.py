"""`hclip train --config CONFIG --out MODEL_DIR`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from models.checkpoint import CheckpointError, prepare_out_dir, save_model
from models.config import ConfigError, RunConfig
from models.data import load_training_records
from models.records import RecordError
from models.training import train_model

log = logging.getLogger(__name__)

USER_ERRORS = (ConfigError, RecordError, CheckpointError)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="training config (JSON)")
    p.add_argument("--out", required=True, type=Path, help="model directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    cfg = RunConfig.load(args.config)
    prepare_out_dir(args.out, args.overwrite)  # fail before the expensive part
    log.info("reading training records from %s", cfg.records_path)
    data = load_training_records(cfg.records_path, cfg.model)
    log.info(
        "%d training tuples, modalities %s, head %s", len(data), cfg.model.names, cfg.model.head
    )
    result = train_model(cfg.model, cfg.train, data, progress=not args.quiet)
    extra = {"train": cfg.to_dict()["train"], "training": result.summary()}
    out = save_model(result.model, args.out, extra=extra, overwrite=args.overwrite)
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
