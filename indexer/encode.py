"""The encoding job: a reader of records, a mapper (the model's encoders), a writer of rows.

Memory is bounded by one batch: records are validated and decoded one batch at a time, encoded
per modality, and appended to the version's row-aligned embedding files and records.jsonl.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from indexer.arrays import NpyAppender
from indexer.artifact import EMBEDDINGS, RECORDS
from models.inputs import InputError, decode
from models.model import MultimodalModel
from models.records import RecordError

log = logging.getLogger(__name__)

RESERVED_KEYS = ("id", "payload")


@dataclass
class Record:
    """A validated record: its decoded inputs and what is stored about it."""

    id: str
    line: int | None
    payload: dict[str, Any]
    inputs: dict[str, Any]  # modality -> decoded input

    def stored(self) -> dict[str, Any]:
        return {"id": self.id, "payload": self.payload, "modalities": sorted(self.inputs)}


@dataclass
class Rejected:
    line: int | None
    id: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "reason": self.reason}


@dataclass
class Validator:
    """Checks records one by one against the model; with skip_bad it collects the rejects."""

    model: MultimodalModel
    base_dir: Path
    skip_bad: bool = False
    seen: dict[str, int | None] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)

    def _check(self, line: int | None, obj: dict[str, Any]) -> Record:
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise RecordError("'id' must be a non-empty string", line)
        if rid in self.seen:
            first = self.seen[rid]
            where = f"line {first}" if first is not None else "an earlier record"
            raise RecordError(f"duplicate id, first seen on {where}", line, rid)
        payload = obj.get("payload", {})
        if not isinstance(payload, dict):
            raise RecordError("'payload' must be a JSON object", line, rid)
        inputs = {}
        for key, value in obj.items():
            if key in RESERVED_KEYS or value is None:
                continue
            if key not in self.model.cfg.modalities:
                raise RecordError(
                    f"unknown modality {key!r} (model has: {', '.join(self.model.names)})",
                    line,
                    rid,
                )
            try:
                inputs[key] = decode(value, self.model.cfg.modalities[key], self.base_dir)
            except InputError as exc:
                raise RecordError(f"{key}: {exc}", line, rid) from None
        if not inputs:
            raise RecordError("record has no modality", line, rid)
        self.seen[rid] = line
        return Record(rid, line, payload, inputs)

    def check(self, line: int | None, obj: dict[str, Any]) -> Record | None:
        try:
            return self._check(line, obj)
        except RecordError as exc:
            if not self.skip_bad:
                raise
            self.rejected.append(Rejected(exc.line, exc.record_id, exc.reason))
            log.warning("skipped: %s", exc)
            return None


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class RowWriter:
    """Appends rows to records.jsonl and one (rows, d) float32 .npy per modality.

    A record lacking a modality gets a zero row there; `modalities` in records.jsonl says which
    rows are real.
    """

    def __init__(self, vdir: Path, names: list[str], dim: int):
        self.names = names
        self.dim = dim
        self.records = open(vdir / RECORDS, "w", encoding="utf-8")  # noqa: SIM115
        self.arrays = {n: NpyAppender(vdir / EMBEDDINGS / f"{n}.npy", dim) for n in names}
        self.rows = 0

    def write(self, stored: list[dict[str, Any]], embs: dict[str, np.ndarray]) -> None:
        """`embs[name]` is (len(stored), d), zero where a record lacks the modality."""
        for rec in stored:
            self.records.write(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n")
        for n in self.names:
            self.arrays[n].append(embs[n])
        self.rows += len(stored)

    def close(self) -> None:
        self.records.close()
        for arr in self.arrays.values():
            arr.close()


@torch.no_grad()
def encode_batch(model: MultimodalModel, batch: list[Record]) -> dict[str, np.ndarray]:
    out = {}
    for name in model.names:
        rows = [i for i, r in enumerate(batch) if name in r.inputs]
        full = np.zeros((len(batch), model.cfg.latent_dim), dtype=np.float32)
        if rows:
            emb = model.encode(name, [batch[i].inputs[name] for i in rows])  # (len(rows), d)
            full[rows] = emb.numpy()
        out[name] = full
    return out


def encode_records(
    model: MultimodalModel,
    source: Iterable[tuple[int, dict[str, Any]]],
    validator: Validator,
    writer: RowWriter,
    batch_size: int,
    progress: bool = True,
) -> int:
    """Validate, encode and write every record of `source`; returns the rows written."""
    checked = (validator.check(line, obj) for line, obj in source)
    valid = (r for r in checked if r is not None)
    bar = tqdm(desc="encode", unit="rec", disable=not progress)
    written = 0
    for batch in batched(valid, batch_size):
        embs = encode_batch(model, batch)
        for name, e in embs.items():
            if not np.isfinite(e).all():  # a model that outputs NaN must not reach an index
                raise RecordError(f"encoder {name!r} produced non-finite values in this batch")
        writer.write([r.stored() for r in batch], embs)
        written += len(batch)
        bar.update(len(batch))
    bar.close()
    return written
