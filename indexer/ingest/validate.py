"""Checking records one at a time: the reference Validator for every message, the validated
record, a rejected one, and the rows the encoders take.

Every way a line can be bad (not JSON, NaN, a wrong type or length, a duplicate id, undecodable
media, a payload that cannot be stored, no modality of the model) is a RecordError for that
line, so `--skip-bad` can leave it out and name it. A field that is no modality of the model is
left out of the record and named once per job (`Record.ignored`, `Checked.ignored`): a file
may carry more modalities than one model uses. indexer.ingest.checks checks whole chunks
at once and hands the records its fast checks do not clear to the Validator, so both name a bad
record alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.ingest.sources import RawRecord
from indexer.store.fields import FieldsWriter, FieldValueError
from models.encoders import decode
from models.limits import DEFAULT_LIMITS, InputError, InputLimits
from models.model import MultimodalModel
from models.records import RecordError, near_miss, parse_line, record_id

log = logging.getLogger(__name__)

RESERVED_KEYS = ("id", "payload")
ARRAY_KINDS = ("vector", "embedding")  # fixed-length numbers: checked and encoded as arrays


@dataclass
class Record:
    """A validated record: its decoded inputs and what is stored about it."""

    id: str
    line: int | None
    payload_json: bytes  # the payload as compact JSON, as the record store keeps it
    inputs: dict[str, Any]  # modality -> decoded input
    ignored: tuple[str, ...] = ()  # its fields that are no modality of the model

    def presence(self, names: list[str]) -> list[bool]:
        return [n in self.inputs for n in names]


@dataclass
class Rejected:
    line: int | None
    id: str | None
    reason: str
    file: str | None = None  # named only when the input has several files

    def to_dict(self) -> dict[str, Any]:
        out = {"line": self.line, "id": self.id, "reason": self.reason}
        return out if self.file is None else {"file": self.file, **out}

    def where(self) -> str:
        """As RecordError names it: `line 3, id 'r-2'` (either part may be missing), with the
        file when the input has several: `line 3 of part-1.jsonl, id 'r-2'`."""
        parts = [f"line {self.line}"] if self.line is not None else []
        if parts and self.file is not None:
            parts[0] += f" of {self.file}"
        parts += [f"id {self.id!r}"] if self.id is not None else []
        return ", ".join(parts) or "a record"


def payload_json(payload: Any, line: int | None, rid: str) -> bytes:
    if not isinstance(payload, dict):
        raise RecordError("'payload' must be a JSON object", line, rid)
    try:
        return orjson.dumps(payload)
    except TypeError as exc:  # e.g. an integer beyond 64 bits, which the store cannot keep
        raise RecordError(f"payload: cannot be stored ({exc})", line, rid) from None


def no_modality(names: list[str], ignored: tuple[str, ...]) -> str:
    """Why a record with none of the model's modalities is bad, with what it has instead."""
    if not ignored:
        return "record has no modality"
    hints = "".join(near_miss(k, names) for k in ignored[:1])
    has = ", ".join(repr(k) for k in ignored)
    return f"record has no modality of the model ({', '.join(names)}), only {has}{hints}"


@dataclass
class Validator:
    """Checks records one by one against the model: the reference for every message.

    A check runs in two stages, so that a duplicate id can be told apart from other mistakes
    by whoever sees the records in order (indexer.ingest.admission): `parse` (is it a JSON object
    with a string id?) and `finish` (payload, filter fields, modalities), with the duplicate check
    between them. `check` runs all three itself, for callers that see every record in order.
    """

    model: MultimodalModel
    base_dir: Path
    skip_bad: bool = False
    filter_fields: tuple[str, ...] = ()
    filter_types: dict[str, str] = field(default_factory=dict)  # the columns an update keeps
    limits: InputLimits = DEFAULT_LIMITS  # its media_root: where media paths may lead
    seen: dict[str, int | None] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)

    def parse(self, line: int | None, raw: RawRecord) -> tuple[dict[str, Any], str]:
        if isinstance(raw, RecordError):
            raise raw
        obj = parse_line(raw, line or 0) if isinstance(raw, bytes) else raw
        return obj, record_id(obj, line)

    def finish(self, obj: dict[str, Any], rid: str, line: int | None) -> Record:
        payload = payload_json(obj.get("payload", {}), line, rid)
        if self.filter_fields:
            try:
                FieldsWriter.check(obj.get("payload") or {}, self.filter_fields, self.filter_types)
            except FieldValueError as exc:
                raise RecordError(str(exc), line, rid) from None
        inputs = {}
        ignored = tuple(
            k for k in obj if k not in self.model.cfg.modalities and k not in RESERVED_KEYS
        )
        for key, value in obj.items():
            if key in RESERVED_KEYS or value is None or key in ignored:
                continue
            try:
                cfg = self.model.cfg.modalities[key]
                inputs[key] = decode(value, cfg, self.base_dir, self.limits)
            except InputError as exc:
                raise RecordError(f"{key}: {exc}", line, rid) from None
        if not inputs:
            raise RecordError(no_modality(self.model.names, ignored), line, rid)
        return Record(rid, line, payload, inputs, ignored)

    def _check(self, line: int | None, raw: RawRecord) -> Record:
        obj, rid = self.parse(line, raw)
        if rid in self.seen:
            first = self.seen[rid]
            where = f"line {first}" if first is not None else "an earlier record"
            raise RecordError(f"duplicate id, first seen on {where}", line, rid)
        record = self.finish(obj, rid, line)
        self.seen[rid] = line
        return record

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


@dataclass
class Rows:
    """Validated records in input order, column by column: what the encoders take and the
    record store keeps. `inputs[name]` is an (n, dim) float32 array for vector and embedding
    modalities (zero rows where absent) and a list of decoded inputs (None where absent) for
    the others; `presence` (n, m) says which are real."""

    locs: np.ndarray  # (n,) int64: indexer.ingest.sources locations
    ids: list[str]
    payloads: list[bytes]
    presence: np.ndarray  # (n, m) bool, the model's modality order
    inputs: dict[str, Any]

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        """Consecutive parts as one, in order."""
        first = parts[0]
        return Rows(
            np.concatenate([p.locs for p in parts]),
            [i for p in parts for i in p.ids],
            [x for p in parts for x in p.payloads],
            np.concatenate([p.presence for p in parts]),
            {
                n: np.concatenate([p.inputs[n] for p in parts])
                if isinstance(v, np.ndarray)
                else [x for p in parts for x in p.inputs[n]]
                for n, v in first.inputs.items()
            },
        )

    def take(self, keep: np.ndarray) -> Rows:
        """The rows where `keep` (n,) bool is true, in order."""
        if bool(keep.all()):
            return self
        idx = np.flatnonzero(keep)
        return Rows(
            self.locs[idx],
            [self.ids[i] for i in idx],
            [self.payloads[i] for i in idx],
            self.presence[idx],
            {
                n: v[idx] if isinstance(v, np.ndarray) else [v[i] for i in idx]
                for n, v in self.inputs.items()
            },
        )
