"""Checking and encoding records: the reference Validator, the rows the encoders take, and the
writer of a version's rows.

Every way a line can be bad (not JSON, NaN, a wrong type or length, an unknown modality, a
duplicate id, undecodable media, a payload that cannot be stored) is a RecordError for that
line, so `--skip-bad` can leave it out and name it. The Validator checks one record at a time and
is the reference for every message; indexer.columnar checks whole chunks at once and hands the
records its fast checks do not clear to the Validator, so both name a bad record alike.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from indexer import cores
from indexer.arrays import NpyAppender
from indexer.artifact import EMBEDDINGS
from indexer.filters import FieldsWriter, FieldValueError
from indexer.recordstore import RecordStoreWriter
from indexer.sources import RawRecord
from indexer.views import FlatViewsWriter
from models.inputs import InputError, decode
from models.model import MultimodalModel
from models.records import RecordError, parse_line

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


@dataclass
class Validator:
    """Checks records one by one against the model: the reference for every message.

    A check runs in two stages, so that a duplicate id can be told apart from other mistakes
    by whoever sees the records in order (indexer.ordering): `parse` (is it a JSON object with a
    string id?) and `finish` (payload, filter fields, modalities), with the duplicate check
    between them. `check` runs all three itself, for callers that see every record in order.
    """

    model: MultimodalModel
    base_dir: Path
    skip_bad: bool = False
    filter_fields: tuple[str, ...] = ()
    seen: dict[str, int | None] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)

    def parse(self, line: int | None, raw: RawRecord) -> tuple[dict[str, Any], str]:
        if isinstance(raw, RecordError):
            raise raw
        obj = parse_line(raw, line or 0) if isinstance(raw, bytes) else raw
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise RecordError("'id' must be a non-empty string", line)
        return obj, rid

    def finish(self, obj: dict[str, Any], rid: str, line: int | None) -> Record:
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
        return Record(rid, line, payload, inputs)

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

    locs: np.ndarray  # (n,) int64: indexer.sources locations
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


@torch.no_grad()
def encode_rows(model: MultimodalModel, rows: Rows, batch_size: int) -> dict[str, np.ndarray]:
    """(n, d) float32 per modality, zero where a row lacks it; `batch_size` rows per encoder
    call. A model that outputs NaN or infinity stops the job: it must not reach an index."""
    out = {}
    for j, name in enumerate(model.names):
        present = np.flatnonzero(rows.presence[:, j])
        everyone = len(present) == len(rows)  # the common case: slices, not gathers
        full = np.zeros((len(rows), model.cfg.latent_dim), dtype=np.float32)
        values = rows.inputs[name]
        for start in range(0, len(present), batch_size):
            idx = present[start : start + batch_size]
            at = slice(start, start + len(idx)) if everyone else idx
            if isinstance(values, np.ndarray):
                emb = _encode_array(model, name, values[at])
            else:
                emb = model.encode(name, [values[i] for i in idx])
            full[at] = emb.numpy()
        if not np.isfinite(full).all():
            raise RecordError(f"encoder {name!r} produced non-finite values in this batch")
        out[name] = full
    return out


def _encode_array(model: MultimodalModel, name: str, x: np.ndarray) -> torch.Tensor:
    # The batch goes to the encoder as it is (MultimodalModel.encode_batch): splitting it into
    # one tensor per row for the featurizer to stack back cost a third of the encoding time.
    batch = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return model.encode_batch(name, batch)


class RowWriter:
    """Appends rows to the record store, one (rows, d) float32 .npy per modality and, when
    given, the exact views (indexer.views.FlatViewsWriter).

    A record lacking a modality gets a zero row there; the store's presence flags say which
    rows are real. Writing runs on a thread of its own, a few batches behind the caller, so
    that encoding never waits for it: copies into the page cache, the views' products and the
    id hashes take a second core, not the encoder's time. The thread starts at the first
    write (a reader process forked before it copies no running thread); its error, if any, is
    raised by the next write_rows or by close().
    """

    def __init__(
        self,
        vdir: Path,
        names: list[str],
        dim: int,
        filter_fields: tuple[str, ...] = (),
        views: FlatViewsWriter | None = None,
    ):
        self.vdir = vdir
        self.names = names
        self.dim = dim
        self.store = RecordStoreWriter(vdir, names, filter_fields)
        (vdir / EMBEDDINGS).mkdir(exist_ok=True)
        self.arrays = {n: NpyAppender(vdir / EMBEDDINGS / f"{n}.npy", dim) for n in names}
        self.views = views
        if views is not None:
            views.embedding_files = self.arrays  # a view that is stored embeddings links them
        self._queue: queue.Queue[Callable[[], Batch | None] | None]
        self._queue = queue.Queue(maxsize=WRITE_BEHIND)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.cpus: frozenset[int] | None = None  # where its thread runs (indexer.cores)

    @property
    def rows(self) -> int:
        return self.store.rows

    def write_rows(
        self,
        ids: list[str],
        payloads: list[bytes],
        presence: np.ndarray,
        embs: dict[str, np.ndarray],
    ) -> None:
        batch = Batch(ids, payloads, presence.reshape(len(ids), len(self.names)), embs)
        self.write_later(lambda: batch)

    def write_later(self, make: Callable[[], Batch | None]) -> None:
        """`make()` runs on the writer thread, in turn: the batch it returns is written (None:
        nothing to write). For work that must happen in row order but need not hold up the
        caller, such as admitting a chunk's ids (indexer.local_engine)."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hclip-writer", daemon=True)
            self._thread.start()
        self._queue.put(make)

    def drain(self) -> None:
        """Wait until everything handed over is written; raise the writer's error if any."""
        self._queue.join()
        self._raise_error()

    def place(self, cpus: frozenset[int]) -> None:
        """Keep the writer's thread to `cpus` from now on (indexer.cores.WriterSide)."""
        self.cpus = cpus
        thread = self._thread
        if thread is not None and thread.native_id is not None:
            cores.place_thread(cpus, thread.native_id)

    def _run(self) -> None:
        if self.cpus is not None:
            cores.place_thread(self.cpus)
        while True:
            make = self._queue.get()
            try:
                if make is None:
                    return
                if self._error is not None:
                    continue  # keep taking work, so that the caller never blocks on a full queue
                batch = make()
                if batch is not None:
                    self._write(batch)
            except BaseException as exc:  # raised in the caller's thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _write(self, b: Batch) -> None:
        self.store.append(b.ids, b.payloads, b.presence)
        for n in self.names:
            self.arrays[n].append(b.embs[n])
        if self.views is not None:
            self.views.append(b.embs, b.presence)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self.store.close()
        for arr in self.arrays.values():
            arr.close()
        if self.views is not None:
            self.views.close()
        self._raise_error()


WRITE_BEHIND = 2  # batches queued for the writer thread


@dataclass
class Batch:
    """Rows for RowWriter: ids, payloads (JSON bytes), (n, m) presence, (n, d) embeddings."""

    ids: list[str]
    payloads: list[bytes]
    presence: np.ndarray
    embs: dict[str, np.ndarray]
