"""The encoding job: a reader of records, a mapper (the model's encoders), a writer of rows.

Memory is bounded by one batch: records are parsed, validated and decoded one batch at a time,
encoded per modality, and appended to the version's row-aligned embedding files and record
store. Every way a line can be bad (not JSON, NaN, a wrong type or length, an unknown modality,
a duplicate id, undecodable media, a payload that cannot be stored) is a RecordError for that
line, so `--skip-bad` can leave it out and name it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from tqdm import tqdm

from indexer.arrays import NpyAppender
from indexer.artifact import EMBEDDINGS
from indexer.filters import FieldsWriter, FieldValueError
from indexer.recordstore import RecordStoreWriter
from models.inputs import InputError, decode
from models.model import MultimodalModel
from models.records import RecordError, parse_line

log = logging.getLogger(__name__)

RESERVED_KEYS = ("id", "payload")

# What a source yields per line: its bytes (JSON Lines), its fields (Parquet), or why it could
# not even be read as a record.
RawRecord = bytes | dict[str, Any] | RecordError


@dataclass
class Record:
    """A validated record: its decoded inputs and what is stored about it."""

    id: str
    line: int | None
    payload_json: bytes  # the payload as compact JSON, as the record store keeps it
    inputs: dict[str, Any]  # modality -> decoded input

    def presence(self, names: list[str]) -> list[bool]:
        return [n in self.inputs for n in names]


@dataclass
class Rejected:
    line: int | None
    id: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "reason": self.reason}

    def where(self) -> str:
        """As RecordError names it: `line 3, id 'r-2'` (either part may be missing)."""
        parts = [f"line {self.line}"] if self.line is not None else []
        parts += [f"id {self.id!r}"] if self.id is not None else []
        return ", ".join(parts) or "a record"


def payload_json(payload: Any, line: int | None, rid: str) -> bytes:
    if not isinstance(payload, dict):
        raise RecordError("'payload' must be a JSON object", line, rid)
    try:
        return orjson.dumps(payload)
    except TypeError as exc:  # e.g. an integer beyond 64 bits, which the store cannot keep
        raise RecordError(f"payload: cannot be stored ({exc})", line, rid) from None


@dataclass
class Validator:
    """Checks records one by one against the model; with skip_bad it collects the rejects."""

    model: MultimodalModel
    base_dir: Path
    skip_bad: bool = False
    filter_fields: tuple[str, ...] = ()
    seen: dict[str, int | None] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)

    def _check(self, line: int | None, raw: RawRecord) -> Record:
        if isinstance(raw, RecordError):
            raise raw
        obj = parse_line(raw, line or 0) if isinstance(raw, bytes) else raw
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise RecordError("'id' must be a non-empty string", line)
        if rid in self.seen:
            first = self.seen[rid]
            where = f"line {first}" if first is not None else "an earlier record"
            raise RecordError(f"duplicate id, first seen on {where}", line, rid)
        payload = payload_json(obj.get("payload", {}), line, rid)
        if self.filter_fields:
            try:
                FieldsWriter.check(obj.get("payload") or {}, self.filter_fields)
            except FieldValueError as exc:
                raise RecordError(str(exc), line, rid) from None
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

    def check(self, line: int | None, raw: RawRecord) -> Record | None:
        try:
            return self._check(line, raw)
        except RecordError as exc:
            if not self.skip_bad:
                raise
            self.reject(exc)
            return None

    def reject(self, exc: RecordError) -> None:
        self.rejected.append(Rejected(exc.line, exc.record_id, exc.reason))
        log.warning("skipped: %s", exc)


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
    """Appends rows to the record store and one (rows, d) float32 .npy per modality.

    A record lacking a modality gets a zero row there; the store's presence flags say which
    rows are real.
    """

    def __init__(self, vdir: Path, names: list[str], dim: int, filter_fields: tuple[str, ...] = ()):
        self.names = names
        self.dim = dim
        self.store = RecordStoreWriter(vdir, names, filter_fields)
        (vdir / EMBEDDINGS).mkdir(exist_ok=True)
        self.arrays = {n: NpyAppender(vdir / EMBEDDINGS / f"{n}.npy", dim) for n in names}

    @property
    def rows(self) -> int:
        return self.store.rows

    def write(self, batch: list[Record], embs: dict[str, np.ndarray]) -> None:
        """`embs[name]` is (len(batch), d), zero where a record lacks the modality."""
        presence = np.array([r.presence(self.names) for r in batch], dtype=bool)
        self.write_rows([r.id for r in batch], [r.payload_json for r in batch], presence, embs)

    def write_rows(
        self,
        ids: list[str],
        payloads: list[bytes],
        presence: np.ndarray,
        embs: dict[str, np.ndarray],
    ) -> None:
        self.store.append(ids, payloads, presence.reshape(len(ids), len(self.names)))
        for n in self.names:
            self.arrays[n].append(embs[n])

    def close(self) -> None:
        self.store.close()
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
    source: Iterable[tuple[int, RawRecord]],
    validator: Validator,
    writer: RowWriter,
    batch_size: int,
    progress: bool = True,
) -> int:
    """Validate, encode and write every record of `source`; returns the rows written."""
    checked = (validator.check(line, raw) for line, raw in source)
    valid = (r for r in checked if r is not None)
    bar = tqdm(desc="encode", unit="rec", disable=not progress)
    written = 0
    for batch in batched(valid, batch_size):
        embs = encode_batch(model, batch)
        for name, e in embs.items():
            if not np.isfinite(e).all():  # a model that outputs NaN must not reach an index
                raise RecordError(f"encoder {name!r} produced non-finite values in this batch")
        writer.write(batch, embs)
        written += len(batch)
        bar.update(len(batch))
    bar.close()
    return written
