"""The record store of a version (docs/design.md §5): id <-> row, payloads and which modalities each
row has, in files that the server memory-maps. Opening a version costs the same at a thousand
records or ten million, and no record becomes a Python object until it is returned.

    records/ids.bin                every id, UTF-8, concatenated in row order
    records/ids.offsets.npy        (N + 1,) int64: row i's id is ids.bin[off[i]:off[i + 1]]
    records/payloads.bin           every payload as compact JSON, concatenated in row order
    records/payloads.offsets.npy   (N + 1,) int64, likewise
    records/presence.npy           (N, m) bool: row i has modality j (the manifest's order)
    records/id_hash.npy            (N,) uint64, sorted: a 64-bit hash of every id
    records/id_row.npy             (N,) int64: the row of each hash, in the same order

An id is looked up by hashing it and binary-searching id_hash (about log2 N pages touched);
every candidate row's stored id is compared, so a hash collision costs a comparison, never a
wrong answer. Payloads are kept as the JSON bytes they were written as: a search copies the k
it returns into its response without parsing them.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.arrays import NpyAppender
from indexer.filters import FIELDS_DIR, FieldColumns, FieldsWriter

DIR = "records"
IDS, IDS_OFF = "ids.bin", "ids.offsets.npy"
PAYLOADS, PAYLOADS_OFF = "payloads.bin", "payloads.offsets.npy"
PRESENCE = "presence.npy"
ID_HASH, ID_ROW = "id_hash.npy", "id_row.npy"


class RecordStoreError(RuntimeError):
    """The record store's files disagree with each other or with the manifest."""


def id_hash(record_id: str) -> int:
    """A stable 64-bit hash of an id (stable across processes, unlike hash())."""
    digest = hashlib.blake2b(record_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def id_hashes(ids: Sequence[str]) -> np.ndarray:
    return np.fromiter((id_hash(i) for i in ids), dtype=np.uint64, count=len(ids))


class RecordStoreWriter:
    """Appends rows in order; close() sorts the id hashes. Memory: the hashes (8 bytes/row),
    and the filterable fields' columns (indexer.filters)."""

    def __init__(self, vdir: Path, names: Sequence[str], filter_fields: Sequence[str] = ()):
        self.dir = vdir / DIR
        self.dir.mkdir()
        self.names = list(names)
        self.fields = FieldsWriter(self.dir, filter_fields)
        self.fields_info: dict[str, dict[str, Any]] = {}
        self._ids = open(self.dir / IDS, "wb")  # noqa: SIM115 - closed in close()
        self._payloads = open(self.dir / PAYLOADS, "wb")  # noqa: SIM115
        self._ids_off = NpyAppender(self.dir / IDS_OFF, None, "<i8")
        self._payloads_off = NpyAppender(self.dir / PAYLOADS_OFF, None, "<i8")
        self._presence = NpyAppender(self.dir / PRESENCE, len(self.names), "|b1")
        self._ids_off.append(np.zeros(1, np.int64))
        self._payloads_off.append(np.zeros(1, np.int64))
        self._id_end = self._payload_end = 0
        self._hashes: list[np.ndarray] = []
        self.rows = 0

    def append(self, ids: Sequence[str], payloads: Sequence[bytes], presence: np.ndarray) -> None:
        """`payloads` are JSON objects already serialised; presence is (len(ids), m) bool."""
        raw_ids = [i.encode("utf-8") for i in ids]
        self._ids.write(b"".join(raw_ids))
        self._payloads.write(b"".join(payloads))
        id_ends = self._id_end + np.cumsum([len(r) for r in raw_ids], dtype=np.int64)
        pl_ends = self._payload_end + np.cumsum([len(p) for p in payloads], dtype=np.int64)
        if len(ids):
            self._id_end, self._payload_end = int(id_ends[-1]), int(pl_ends[-1])
        self._ids_off.append(id_ends)
        self._payloads_off.append(pl_ends)
        self._presence.append(np.asarray(presence, dtype=bool).reshape(len(ids), len(self.names)))
        self._hashes.append(id_hashes(ids))
        self.fields.append(payloads)
        self.rows += len(ids)

    def close(self) -> None:
        if self._ids.closed:
            return
        for f in (self._ids, self._payloads):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for a in (self._ids_off, self._payloads_off, self._presence):
            a.close()
        hashes = np.concatenate(self._hashes) if self._hashes else np.zeros(0, np.uint64)
        order = np.argsort(hashes, kind="stable")
        np.save(self.dir / ID_HASH, hashes[order])
        np.save(self.dir / ID_ROW, order.astype(np.int64))
        self._hashes.clear()
        self.fields_info = self.fields.close()


def _map_bytes(path: Path) -> mmap.mmap | bytes:
    if path.stat().st_size == 0:
        return b""  # mmap refuses empty files
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class RecordStore:
    """One version's records, opened read-only and memory-mapped."""

    def __init__(
        self,
        vdir: Path,
        names: Sequence[str],
        filter_fields: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        d = vdir / DIR
        self.names = list(names)
        try:
            self._ids = _map_bytes(d / IDS)
            self._payloads = _map_bytes(d / PAYLOADS)
            self._ids_off = np.load(d / IDS_OFF, mmap_mode="r")
            self._payloads_off = np.load(d / PAYLOADS_OFF, mmap_mode="r")
            self.presence = np.load(d / PRESENCE, mmap_mode="r")
            self._hash = np.load(d / ID_HASH, mmap_mode="r")
            self._hash_row = np.load(d / ID_ROW, mmap_mode="r")
            self.fields = FieldColumns(d, filter_fields or {})
        except (OSError, ValueError, KeyError) as exc:
            raise RecordStoreError(f"{d}: cannot open the record store ({exc})") from None
        self._check_shapes(d)

    def _check_shapes(self, d: Path) -> None:
        """O(1) consistency: the arrays' lengths and the blobs' sizes agree."""
        n = len(self._hash)
        problems = []
        if self.presence.shape != (n, len(self.names)):
            problems.append(f"{PRESENCE} has shape {self.presence.shape}, expected ({n}, m)")
        for name, off, blob in (
            (IDS_OFF, self._ids_off, self._ids),
            (PAYLOADS_OFF, self._payloads_off, self._payloads),
        ):
            if off.shape != (n + 1,):
                problems.append(f"{name} has {off.shape[0]} entries, expected {n + 1}")
            elif int(off[-1]) != len(blob):
                problems.append(f"{name} ends at byte {int(off[-1])}, its blob has {len(blob)}")
        if self._hash_row.shape != (n,):
            problems.append(f"{ID_ROW} has {self._hash_row.shape[0]} entries, expected {n}")
        for name, col in [*self.fields.num.items(), *self.fields.codes.items()]:
            if col.shape != (n,):
                problems.append(f"{FIELDS_DIR}/{name} has {col.shape[0]} rows, expected {n}")
        if problems:
            raise RecordStoreError(f"{d}: " + "; ".join(problems))

    def __len__(self) -> int:
        return int(self._hash.shape[0])

    def id_at(self, row: int) -> str:
        a, b = int(self._ids_off[row]), int(self._ids_off[row + 1])
        return bytes(self._ids[a:b]).decode("utf-8")

    def payload_json(self, row: int) -> bytes:
        """The payload's JSON bytes, as stored: splice them into a response without parsing."""
        a, b = int(self._payloads_off[row]), int(self._payloads_off[row + 1])
        return bytes(self._payloads[a:b])

    def payload(self, row: int) -> dict[str, Any]:
        obj: dict[str, Any] = orjson.loads(self.payload_json(row))
        return obj

    def modalities(self, row: int) -> list[str]:
        have = self.presence[row]
        return [n for n, h in zip(self.names, have.tolist(), strict=True) if h]

    def __getitem__(self, row: int) -> dict[str, Any]:
        """{"id", "payload", "modalities"}: the contract of GET /v1/records/{id}."""
        if not 0 <= row < len(self):
            raise IndexError(row)
        return {
            "id": self.id_at(row),
            "payload": self.payload(row),
            "modalities": self.modalities(row),
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for row in range(len(self)):
            yield self[row]

    def row_of(self, record_id: str) -> int | None:
        h = np.uint64(id_hash(record_id))
        lo = int(np.searchsorted(self._hash, h, side="left"))
        raw = record_id.encode("utf-8")
        while lo < len(self) and self._hash[lo] == h:
            row = int(self._hash_row[lo])
            a, b = int(self._ids_off[row]), int(self._ids_off[row + 1])
            if self._ids[a:b] == raw:
                return row
            lo += 1
        return None

    def present(self, name: str) -> np.ndarray:
        """(N,) bool: the rows that have modality `name` (reads the whole column)."""
        return np.ascontiguousarray(self.presence[:, self.names.index(name)])

    def iter_chunks(
        self, size: int = 8192
    ) -> Iterator[tuple[int, list[str], list[bytes], np.ndarray]]:
        """(first row, ids, payload JSON, presence) in row order, `size` rows at a time: for
        jobs that copy rows into a new version without parsing them."""
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            ids_off = np.asarray(self._ids_off[start : stop + 1])
            pl_off = np.asarray(self._payloads_off[start : stop + 1])
            id_blob = bytes(self._ids[int(ids_off[0]) : int(ids_off[-1])])
            pl_blob = bytes(self._payloads[int(pl_off[0]) : int(pl_off[-1])])
            ids_rel, pl_rel = ids_off - ids_off[0], pl_off - pl_off[0]
            ids = [
                id_blob[int(ids_rel[i]) : int(ids_rel[i + 1])].decode("utf-8")
                for i in range(stop - start)
            ]
            payloads = [pl_blob[int(pl_rel[i]) : int(pl_rel[i + 1])] for i in range(stop - start)]
            yield start, ids, payloads, np.asarray(self.presence[start:stop])

    def problems(self) -> list[str]:
        """The full O(N) check for `hclip index verify`: offsets never decrease, every id
        hashes to what the index says, the index is a permutation, payloads are JSON objects."""
        out = []
        for name, off in ((IDS_OFF, self._ids_off), (PAYLOADS_OFF, self._payloads_off)):
            if len(off) and (int(off[0]) != 0 or bool((np.diff(off) < 0).any())):
                out.append(f"{DIR}/{name}: offsets do not increase from 0")
        if out:
            return out
        n = len(self)
        hashes, hash_rows = np.asarray(self._hash), np.asarray(self._hash_row)
        if n > 1 and bool((hashes[1:] < hashes[:-1]).any()):
            out.append(f"{DIR}/{ID_HASH}: not sorted")
        position = np.full(n, -1, np.int64)  # row -> its entry in id_hash
        if bool(((hash_rows < 0) | (hash_rows >= n)).any()):
            return [*out, f"{DIR}/{ID_ROW}: holds rows outside 0..{n - 1}"]
        position[hash_rows] = np.arange(n)
        if bool((position < 0).any()):
            return [*out, f"{DIR}/{ID_ROW}: not a permutation of the rows"]
        for start, ids, payloads, _ in self.iter_chunks():
            wrong = np.flatnonzero(hashes[position[start : start + len(ids)]] != id_hashes(ids))
            if len(wrong):
                return [*out, f"{DIR}/{ID_HASH}: row {start + int(wrong[0])}'s id is not indexed"]
            for i, p in enumerate(payloads):
                try:
                    ok = isinstance(orjson.loads(p), dict)
                except orjson.JSONDecodeError:
                    ok = False
                if not ok:
                    return [*out, f"{DIR}/{PAYLOADS}: row {start + i}'s payload is not an object"]
        return out

    def close(self) -> None:
        for m in (self._ids, self._payloads):
            if isinstance(m, mmap.mmap):
                m.close()
