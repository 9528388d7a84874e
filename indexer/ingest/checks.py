"""Checking records a chunk at a time: columnar fast checks, and the reference for the rest.

A chunk (indexer.ingest.sources.Chunk) is parsed once (orjson per JSON line; Parquet columns
stay Arrow arrays) and checked column by column with numpy: vector lengths, finiteness, bounds
and types at once for the whole chunk. A record that any fast check does not clear, for
whatever reason, is handed to the reference Validator (indexer.ingest.validate), which either
accepts it or names its mistake exactly as it always has. So the fast checks only decide which
records need a closer look: a too-strict fast check costs time, never a different answer.

Duplicate ids are not checked here: that needs every earlier record, in order, which the
caller has (indexer.ingest.admission); each reject says whether the Validator stopped before the
duplicate check (`parse`) or after (`finish`), so that the caller names it as the Validator
would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from indexer.ingest import arrow_numpy
from indexer.ingest.jsonl_vectors import VectorLines
from indexer.ingest.sources import Chunk, parquet_record, unpack
from indexer.ingest.validate import ARRAY_KINDS, RESERVED_KEYS, Record, Rows, Validator
from indexer.store.fields import FieldsWriter, FieldValueError
from indexer.store.recordstore import joined, object_lines
from models.encoders import decode
from models.limits import FLOAT32_MAX, InputError
from models.records import RecordError

PARSE, FINISH = "parse", "finish"  # the Validator stage a reject came from
# A JSON-string payload with an integer of 19+ digits: orjson would read it as a float where the
# reference (json) keeps the integer, so such payloads take the reference path.
LONG_INTEGER = r"\d{19}"
_EMPTY: dict[str, Any] = {}  # the payload of a record without one (never modified)
PARSE_ROWS = 1024  # JSON lines parsed at once
# The vector-lines path hands a chunk to the general one when more than 1/REFER_AT_MOST of its
# lines need the reference, which checks one line at a time.
REFER_AT_MOST = 8


@dataclass
class Reject:
    loc: int
    id: str | None
    reason: str
    stage: str  # PARSE: stopped before the duplicate check; FINISH: after it


@dataclass
class Checked:
    """A chunk after checking: its valid records (in order) and its rejects."""

    rows: Rows
    rejects: list[Reject] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)  # field -> first location

    @staticmethod
    def concat(parts: list[Checked]) -> Checked:
        ignored: dict[str, int] = {}
        for p in parts:
            first_seen(ignored, p.ignored)
        return Checked(
            Rows.concat([p.rows for p in parts]), [r for p in parts for r in p.rejects], ignored
        )


def first_seen(into: dict[str, int], more: dict[str, int]) -> None:
    """Merge `more` into `into`, keeping each field's earliest location."""
    for name, loc in more.items():
        if name not in into or loc < into[name]:
            into[name] = loc


class ChunkChecker:
    """The columnar checks of one model; `validator` (the reference) gets the hard cases."""

    def __init__(self, validator: Validator):
        self.validator = validator
        self.model = validator.model
        self.names = list(self.model.names)
        self.cfgs = self.model.cfg.modalities
        self.allowed = set(self.names) | set(RESERVED_KEYS)
        self.fields = validator.filter_fields
        self.field_types = validator.filter_types
        self.referred = 0  # records the fast checks handed to the reference (for tests, logs)
        self.vector_lines: VectorLines | None = None
        if all(self.cfgs[n].kind in ARRAY_KINDS for n in self.names) and VectorLines.available():
            dims = {n: self.cfgs[n].dim for n in self.names}
            self.vector_lines = VectorLines({n: d for n, d in dims.items() if d is not None})

    def check(self, chunk: Chunk) -> Checked:
        if chunk.lines is None:
            return self._check_parquet(chunk)
        if self.vector_lines is not None:
            checked = self._check_vector_lines(chunk)
            if checked is not None:
                return checked
        # Parsed JSON costs some 3 kB a record (a Python float per number): parse a slice at a
        # time, so that a chunk in flight holds its arrays, not its objects.
        parts = [
            self._check_jsonl(
                Chunk(chunk.locs[s : s + PARSE_ROWS], lines=chunk.lines[s : s + PARSE_ROWS])
            )
            for s in range(0, len(chunk), PARSE_ROWS)
        ]
        return parts[0] if len(parts) == 1 else Checked.concat(parts)

    # -- JSON Lines -------------------------------------------------------------------------

    def _check_jsonl(self, chunk: Chunk) -> Checked:
        assert chunk.lines is not None
        lines = chunk.lines
        n = len(lines)
        loads, dumps, allowed = orjson.loads, orjson.dumps, self.allowed
        objs: list[dict[str, Any] | None] = [None] * n
        ids: list[Any] = [None] * n
        payloads: list[bytes] = [b""] * n
        extra: list[int] = []  # records with fields that are no modality
        # One pass over the lines, kept lean: this loop is most of a JSON Lines build's work.
        for i, raw in enumerate(lines):
            try:
                obj = loads(raw)
                rid = obj["id"]  # a TypeError for anything but an object
                payload = obj.get("payload", _EMPTY)
                if type(rid) is str and rid and type(payload) is dict and self._fields_ok(payload):
                    payloads[i] = dumps(payload)  # a TypeError if the store cannot keep it
                    ids[i] = rid
                    objs[i] = obj
                    if not obj.keys() <= allowed:
                        extra.append(i)
            except (orjson.JSONDecodeError, TypeError, KeyError):
                pass
        ignored: dict[str, int] = {}
        for i in extra:
            for name in objs[i].keys() - allowed:  # type: ignore[union-attr]
                ignored.setdefault(name, int(chunk.locs[i]))
        suspect = np.array([o is None for o in objs], dtype=bool)
        maybe_bool = [b"true" in raw or b"false" in raw for raw in lines]
        inputs: dict[str, Any] = {}
        presence = np.zeros((n, len(self.names)), dtype=bool)
        for j, name in enumerate(self.names):
            values = [o.get(name) if o is not None else None for o in objs]
            if self.cfgs[name].kind in ARRAY_KINDS:
                inputs[name], presence[:, j] = self._array_from_lists(
                    name, values, maybe_bool, suspect
                )
            else:
                inputs[name], presence[:, j] = self._decoded(name, values, suspect)
        return self._finish_chunk(chunk, ids, payloads, presence, inputs, suspect, ignored)

    def _check_vector_lines(self, chunk: Chunk) -> Checked | None:
        """Records of vector modalities only, without a Python float per number
        (indexer.ingest.jsonl_vectors); None when that path cannot take the chunk."""
        assert chunk.lines is not None and self.vector_lines is not None
        parsed = self.vector_lines.parse(chunk.lines)
        if parsed is None:
            return None
        n, suspect = len(chunk.lines), parsed.suspect
        if np.count_nonzero(suspect) > n // REFER_AT_MOST:
            return None  # e.g. fields of other modalities: the general path takes them in bulk
        ids: list[Any] = parsed.ids
        suspect |= np.fromiter((not rid for rid in ids), bool, n)  # refused, or an empty id
        # a record without a payload has the empty one, as the reference stores it
        raws = [raw or b"{}" for raw in parsed.payloads]
        payloads = None if self.fields else self._canonical(raws)
        if payloads is None:
            payloads = [b""] * n
            loads, dumps = orjson.loads, orjson.dumps
            for i, raw in enumerate(raws):
                if suspect[i]:
                    continue
                try:
                    payload = loads(raw)
                    if type(payload) is not dict or not self._fields_ok(payload):
                        suspect[i] = True
                        continue
                    payloads[i] = dumps(payload)  # a TypeError if the store cannot keep it
                except (orjson.JSONDecodeError, TypeError):
                    suspect[i] = True
        inputs: dict[str, Any] = {}
        presence = np.zeros((n, len(self.names)), dtype=bool)
        for j, name in enumerate(self.names):
            values, present = parsed.vectors[name], parsed.present[name] & ~suspect
            idx = np.flatnonzero(present)
            ok = self._array_rows_ok(name, values[idx])
            suspect[idx[~ok]] = True
            present[idx[~ok]] = False
            out = np.zeros((n, values.shape[1]), dtype=np.float32)
            out[present] = values[present]
            inputs[name], presence[:, j] = out, present
        return self._finish_chunk(chunk, ids, payloads, presence, inputs, suspect)

    def _fields_ok(self, payload: dict[str, Any]) -> bool:
        if not self.fields:
            return True  # the common case: no filter fields declared
        try:
            FieldsWriter.check(payload, self.fields, self.field_types)
        except FieldValueError:
            return False
        return True

    def _array_from_lists(
        self, name: str, values: list[Any], maybe_bool: list[bool], suspect: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(n, dim) float32 and (n,) presence from parsed JSON values; a row that is not a
        list of `dim` finite numbers becomes a suspect."""
        dim = self.cfgs[name].dim
        assert dim is not None
        out = np.zeros((len(values), dim), dtype=np.float32)
        kept = [i for i, v in enumerate(values) if v is not None]
        if not kept:
            return out, np.zeros(len(values), dtype=bool)
        # A JSON true is not the number 1, though numpy would take it as one: only lines that
        # hold `true` or `false` somewhere need their elements looked at one by one.
        if any(maybe_bool[i] for i in kept):
            bools = [
                i
                for i in kept
                if maybe_bool[i]
                and type(values[i]) is list
                and any(type(x) is bool for x in values[i])
            ]
            suspect[bools] = True
            kept = [i for i in kept if not suspect[i]]
        # np.array succeeds with shape (k, dim) only if every value is a sequence of `dim`
        # numbers, each converted as decode_vector converts it; otherwise look row by row.
        try:
            arr = np.array([values[i] for i in kept], dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            arr = None
        if arr is None or arr.shape != (len(kept), dim):
            converts = [
                i for i in kept if type(values[i]) is list and self._row_converts(values[i], dim)
            ]
            suspect[sorted(set(kept) - set(converts))] = True
            kept = converts
            arr = np.array([values[i] for i in kept], dtype=np.float64).reshape(-1, dim)
        idx = np.asarray(kept, dtype=np.int64)
        ok = self._array_rows_ok(name, arr)
        suspect[idx[~ok]] = True
        out[idx[ok]] = arr[ok]
        present = np.zeros(len(values), dtype=bool)
        present[idx[ok]] = True
        return out, present

    @staticmethod
    def _row_converts(value: list[Any], dim: int) -> bool:
        try:
            return np.asarray(value, dtype=np.float64).shape == (dim,)
        except (TypeError, ValueError, OverflowError):
            return False

    def _array_rows_ok(self, name: str, arr: np.ndarray) -> np.ndarray:
        """(k,) bool: finite, within float32 (the decoder's default bound), and for embeddings
        not all zeros (decode_vector and decode_embedding refuse the rest)."""
        with np.errstate(invalid="ignore", over="ignore"):
            ok = np.isfinite(arr).all(axis=1) & (
                np.abs(arr).max(axis=1, initial=0.0) <= FLOAT32_MAX
            )
        if self.cfgs[name].kind == "embedding":
            ok &= arr.any(axis=1)
        return ok

    def _decoded(
        self, name: str, values: list[Any], suspect: np.ndarray
    ) -> tuple[list[Any], np.ndarray]:
        """Other kinds (text, image, audio, plugins) are decoded one by one, as ever."""
        cfg, base, limits = self.cfgs[name], self.validator.base_dir, self.validator.limits
        out: list[Any] = [None] * len(values)
        present = np.zeros(len(values), dtype=bool)
        for i, v in enumerate(values):
            if v is None or suspect[i]:
                continue
            try:
                out[i] = decode(v, cfg, base, limits)
                present[i] = True
            except InputError:
                suspect[i] = True
        return out, present

    # -- Parquet ----------------------------------------------------------------------------

    def _check_parquet(self, chunk: Chunk) -> Checked:
        import pyarrow as pa

        table = chunk.table
        n = len(chunk)
        suspect = np.zeros(n, dtype=bool)
        cols = {name: table.column(i) for i, name in enumerate(table.schema.names)}
        ignored: dict[str, int] = {}
        for name in [c for c in cols if c not in self.allowed]:  # no modality: left out
            valid = np.flatnonzero(arrow_numpy.valid(cols.pop(name)))
            if len(valid):
                ignored[name] = int(chunk.locs[valid[0]])
        ids: list[Any] = [None] * n
        id_col = cols.get("id")
        if id_col is not None and (
            pa.types.is_string(id_col.type) or pa.types.is_large_string(id_col.type)
        ):
            ids = id_col.to_pylist()  # any other type: the reference names the mistake
        suspect |= np.array([not rid for rid in ids], dtype=bool)
        payloads = self._parquet_payloads(cols.get("payload"), suspect, pa)
        inputs: dict[str, Any] = {}
        presence = np.zeros((n, len(self.names)), dtype=bool)
        for j, name in enumerate(self.names):
            col = cols.get(name)
            if col is None:  # no such column: no record has the modality
                dim = self.cfgs[name].dim
                array = self.cfgs[name].kind in ARRAY_KINDS
                inputs[name] = np.zeros((n, dim or 0), np.float32) if array else [None] * n
            elif self.cfgs[name].kind in ARRAY_KINDS:
                inputs[name], presence[:, j] = self._array_from_arrow(name, col, suspect, pa)
            else:
                inputs[name], presence[:, j] = self._decoded(name, col.to_pylist(), suspect)
        return self._finish_chunk(chunk, ids, payloads, presence, inputs, suspect, ignored)

    def _parquet_payloads(self, col: Any, suspect: np.ndarray, pa: Any) -> list[bytes]:
        import pyarrow.compute as pc

        n = len(suspect)
        if col is None:
            return [b"{}"] * n
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            suspect |= arrow_numpy.booleans(pc.match_substring_regex(col, LONG_INTEGER))
            canonical = self._canonical_payloads(col)
            if canonical is not None:
                return canonical
        values = col.to_pylist()
        out = [b""] * n
        for i, v in enumerate(values):
            if suspect[i]:
                continue
            if v is None:
                out[i] = b"{}"
                continue
            if type(v) is str:
                try:
                    v = orjson.loads(v)
                except orjson.JSONDecodeError:
                    suspect[i] = True
                    continue
            if type(v) is not dict or not self._fields_ok(v):
                suspect[i] = True
                continue
            try:
                out[i] = orjson.dumps(v)
            except TypeError:
                suspect[i] = True
        return out

    def _canonical_payloads(self, col: Any) -> list[bytes] | None:
        """A Parquet column of JSON-string payloads as _canonical_blob keeps them; None with
        filter fields (checked value by value) or nulls."""
        if self.fields or col.null_count:
            return None
        return _canonical_blob(*arrow_numpy.strings(col))

    @staticmethod
    def _canonical(raws: list[bytes]) -> list[bytes] | None:
        offsets = np.zeros(len(raws) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, raws), np.int64, len(raws)), out=offsets[1:])
        return _canonical_blob(b"".join(raws), offsets)

    def _array_from_arrow(
        self, name: str, col: Any, suspect: np.ndarray, pa: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """(n, dim) float32 and (n,) presence from a list or fixed-size-list column, read from
        its Arrow buffers: no Python object per value."""
        dim = self.cfgs[name].dim
        assert dim is not None
        n = len(col)
        out = np.zeros((n, dim), dtype=np.float32)
        present = arrow_numpy.valid(col)
        typ = col.type
        listlike = (
            pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
        )
        if not listlike or not arrow_numpy.is_numeric(typ.value_type):
            suspect |= present  # booleans, strings, nested lists: the reference names them
            return out, np.zeros(n, dtype=bool)
        child = col.values  # the whole child array: offsets index into it
        if pa.types.is_fixed_size_list(typ):
            size = typ.list_size
            starts = (col.offset + np.arange(n, dtype=np.int64)) * size
            lengths = np.full(n, size, dtype=np.int64)
        else:
            offsets = arrow_numpy.numbers(col.offsets).astype(np.int64)
            starts, lengths = offsets[:-1], np.diff(offsets)
        if child.null_count:  # a null inside a vector: its row goes to the reference
            nulls = np.concatenate([[0], np.cumsum(~arrow_numpy.valid(child))])
            suspect |= present & (nulls[starts + lengths] - nulls[starts] > 0)
        flat = arrow_numpy.numbers(child)
        good = present & (lengths == dim) & ~suspect
        suspect |= present & (lengths != dim)
        idx = np.flatnonzero(good)
        arr = flat[starts[idx, None] + np.arange(dim)].astype(np.float64)  # (k, dim)
        ok = self._array_rows_ok(name, arr)
        suspect[idx[~ok]] = True
        out[idx[ok]] = arr[ok]
        return out, present & ~suspect

    # -- both -------------------------------------------------------------------------------

    def _finish_chunk(
        self,
        chunk: Chunk,
        ids: list[Any],
        payloads: list[bytes],
        presence: np.ndarray,
        inputs: dict[str, Any],
        suspect: np.ndarray,
        ignored: dict[str, int] | None = None,
    ) -> Checked:
        """Records with no modality join the suspects; the reference then checks every suspect,
        and those it accepts rejoin the chunk with what it decoded. `ignored`: the fields that
        are no modality, as the fast checks found them (the reference adds its own)."""
        ignored = {} if ignored is None else ignored
        suspect |= ~presence.any(axis=1)
        # The parsers above refuse lone surrogates, but not a NUL: an id holding one is bad.
        suspect |= np.fromiter((type(r) is str and "\x00" in r for r in ids), bool, len(ids))
        presence[suspect] = False
        rejects: list[Reject] = []
        for i in np.flatnonzero(suspect):
            self.referred += 1
            loc = int(chunk.locs[i])
            try:
                record = self._reference(chunk, int(i), loc)
            except _Stage as stage:
                exc = stage.error
                rejects.append(Reject(loc, exc.record_id, exc.reason, stage.stage))
                continue
            ids[i], payloads[i] = record.id, record.payload_json
            first_seen(ignored, dict.fromkeys(record.ignored, loc))
            for j, name in enumerate(self.names):
                value = record.inputs.get(name)
                presence[i, j] = value is not None
                if value is None:
                    continue
                if isinstance(inputs[name], np.ndarray):
                    inputs[name][i] = value.numpy()
                else:
                    inputs[name][i] = value
            suspect[i] = False
        rows = Rows(chunk.locs, ids, payloads, presence, inputs)
        return Checked(rows.take(~suspect), rejects, ignored)

    def _reference(self, chunk: Chunk, i: int, loc: int) -> Record:
        if chunk.lines is not None:
            raw: Any = chunk.lines[i]
        else:
            raw = parquet_record(chunk.table.slice(i, 1).to_pylist()[0], unpack(loc)[1])
        try:
            obj, rid = self.validator.parse(loc, raw)
        except RecordError as exc:
            raise _Stage(PARSE, exc) from None
        try:
            return self.validator.finish(obj, rid, loc)
        except RecordError as exc:
            raise _Stage(FINISH, exc) from None


def _canonical_blob(blob: bytes, offsets: np.ndarray) -> list[bytes] | None:
    """The payloads packed in `blob` as they are, when every one is a JSON object already
    written as the store keeps it (orjson's compact form): two C calls for the chunk (parse
    all, write all back and compare) instead of a parse and a write per record. None when any
    is not: the caller then parses them one by one."""
    objs = object_lines(blob, offsets)
    try:
        if objs is None or orjson.dumps(objs) != b"[" + joined(blob, offsets, b",") + b"]":
            return None
    except TypeError:  # orjson.JSONEncodeError: an integer beyond 64 bits
        return None
    bounds = offsets.tolist()
    return [blob[bounds[i] : bounds[i + 1]] for i in range(len(objs))]


class _Stage(Exception):
    def __init__(self, stage: str, error: RecordError):
        super().__init__(stage)
        self.stage = stage
        self.error = error
