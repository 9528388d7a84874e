"""Experiment logs (`train.log_dir`): TensorBoard event files, and the same scalars as JSON Lines
(`metrics.jsonl`) for people without TensorBoard.

A row is `{"kind": "train" | "validation", "step", "epoch", ...figures}`; a validation row holds
its per-view figures under `views`. In TensorBoard each number is a scalar tagged
`train/<name>` or `validation/<name>`, per view `validation/<view>/<metric>`. Each JSON line is
written whole and flushed, so a run killed at any moment leaves whole lines behind it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from models.extras import require

METRICS_FILE = "metrics.jsonl"


def scalars(row: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in a row, nested dicts flattened with `/`."""
    for key, value in row.items():
        if key in ("kind", "step"):
            continue
        if isinstance(value, Mapping):
            yield from scalars(value, f"{prefix}{key}/")
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            yield f"{prefix}{key}", float(value)


class ExperimentLog:
    """Opened at the start of a run (so a missing `tensorboard` stops it before any training)."""

    def __init__(self, log_dir: Path):
        require("tensorboard", "tensorboard", "train.log_dir (TensorBoard event files)")
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))
        # Appended to on resume: the rows before the checkpoint stay, as the event files do.
        self.jsonl = open(log_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        for tag, value in scalars(row, f"{row['kind']}/"):
            self.writer.add_scalar(tag, value, step)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()
