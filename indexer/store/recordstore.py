"""The record store of a version (docs/design.md §5): id <-> row, payloads and which modalities each
row has, in files that the server memory-maps. Opening a version costs the same at a thousand
records or ten million, and no record becomes a Python object until it is returned.

    records/ids.bin                every id, UTF-8, concatenated in row order
    records/ids.offsets.npy        (N + 1,) int64: row i's id is ids.bin[off[i]:off[i + 1]]
    records/payloads.bin           every payload as compact JSON, concatenated in row order
    records/payloads.offsets.npy   (N + 1,) int64, likewise
    records/presence.npy           (N, m) bool: row i has modality j (the manifest's order)
    records/id_hash.npy            (N,) uint64, sorted: a 64-bit hash of every id (below)
    records/id_row.npy             (N,) int64: the row of each hash, in the same order

An id is looked up by hashing it and binary-searching id_hash (about log2 N pages touched);
every candidate row's stored id is compared, so a hash collision costs a comparison, never a
wrong answer. Payloads are kept as the JSON bytes they were written as: a search copies the k
it returns into its response without parsing them.

The id hash is named in the manifest (`id_hash`). This hclip writes `words64`: the UTF-8 id read
as little-endian 64-bit words, each mixed in by a multiply and shift, then murmur3's
finaliser. numpy computes it for a whole chunk of ids at once (a pass per word, over the ids that
long), where the earlier `blake2b-64` (format 2, still read) cost a Python call per id. It is
not keyed:
ids made to collide cost comparisons in a lookup, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson

from indexer.store.arrays import NpyAppender, start_writeback
from indexer.store.fields import FIELDS_DIR, FieldColumns, FieldsWriter

DIR = "records"
IDS, IDS_OFF = "ids.bin", "ids.offsets.npy"
PAYLOADS, PAYLOADS_OFF = "payloads.bin", "payloads.offsets.npy"
PRESENCE = "presence.npy"
ID_HASH, ID_ROW = "id_hash.npy", "id_row.npy"


class RecordStoreError(RuntimeError):
    """The record store's files disagree with each other or with the manifest."""


_MASK = (1 << 64) - 1
_K_LEN, _K_WORD = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD
_K_FIN1, _K_FIN2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
ID_HASH_KIND = "words64"  # what this hclip writes
LEGACY_ID_HASH_KIND = "blake2b-64"  # format 2 versions


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * _K_FIN1) & _MASK
    h ^= h >> 33
    h = (h * _K_FIN2) & _MASK
    return h ^ (h >> 33)


def words64(raw: bytes) -> int:
    """One id's hash (its UTF-8 bytes): the reference for words64_packed."""
    h = (len(raw) * _K_LEN) & _MASK
    for i in range(0, len(raw), 8):
        h = ((h ^ int.from_bytes(raw[i : i + 8], "little")) * _K_WORD) & _MASK
        h ^= h >> 32
    return _fmix(h)


def words64_packed(blob: bytes | np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(n,) uint64: words64 of ids packed as UTF-8 `blob`, id i at blob[offsets[i]:offsets[i + 1]]
    (offsets relative to the blob's start)."""
    data = np.frombuffer(blob, dtype=np.uint8) if isinstance(blob, bytes) else blob
    offsets = np.asarray(offsets, dtype=np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    padded = np.concatenate([data, np.zeros(8, np.uint8)])  # a last word may read past the end
    h = lengths.astype(np.uint64) * np.uint64(_K_LEN)
    words = (lengths + 7) // 8
    lane = np.arange(8)
    for j in range(int(words.max(initial=0))):
        rows = np.flatnonzero(words > j)  # the ids with a j-th word
        at = starts[rows] + 8 * j
        raw = padded[at[:, None] + lane]  # (k, 8): this word's bytes and whatever follows
        raw[lane >= (lengths[rows] - 8 * j)[:, None]] = 0  # bytes past the id's end
        x = (h[rows] ^ raw.view("<u8").ravel()) * np.uint64(_K_WORD)
        h[rows] = x ^ (x >> np.uint64(32))
    for k in (_K_FIN1, _K_FIN2):
        h ^= h >> np.uint64(33)
        h *= np.uint64(k)
    return h ^ (h >> np.uint64(33))


def blake2b64(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _blake2b64_packed(blob: bytes | np.ndarray, offsets: np.ndarray) -> np.ndarray:
    data = bytes(blob)
    bounds = np.asarray(offsets, dtype=np.int64).tolist()
    n = len(bounds) - 1
    return np.fromiter(
        (blake2b64(data[bounds[i] : bounds[i + 1]]) for i in range(n)), dtype=np.uint64, count=n
    )


# kind -> (one id's UTF-8 bytes -> hash, (blob, offsets) -> hashes)
ID_HASHES: dict[str, tuple[Callable[[bytes], int], Callable[..., np.ndarray]]] = {
    ID_HASH_KIND: (words64, words64_packed),
    LEGACY_ID_HASH_KIND: (blake2b64, _blake2b64_packed),
}


def id_hash_of(manifest: Mapping[str, Any]) -> str:
    """The id hash a version's store was written with: named since format 3."""
    kind = str(manifest.get("id_hash", LEGACY_ID_HASH_KIND))
    if kind not in ID_HASHES:
        raise RecordStoreError(f"unknown id hash {kind!r} (this hclip knows {sorted(ID_HASHES)})")
    return kind


def pack_ids(ids: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """(UTF-8 blob, (n + 1,) int64 offsets from 0) of `ids`, without a Python call per id when
    they are ASCII (then each id's byte length is its length)."""
    blob = "".join(ids).encode("utf-8")
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if len(blob) != int(lengths.sum()):  # some id is not ASCII
        lengths = np.fromiter((len(i.encode("utf-8")) for i in ids), np.int64, len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return blob, offsets


def id_hashes(ids: Sequence[str], kind: str = ID_HASH_KIND) -> np.ndarray:
    blob, offsets = pack_ids(ids)
    return ID_HASHES[kind][1](blob, offsets)


class RecordStoreWriter:
    """Appends rows in order; close() sorts the id hashes. Memory: the hashes (8 bytes/row),
    and the filterable fields' columns (indexer.store.fields)."""

    def __init__(
        self,
        vdir: Path,
        names: Sequence[str],
        filter_fields: Sequence[str] = (),
        field_types: Mapping[str, str] | None = None,
    ):
        self.dir = vdir / DIR
        self.dir.mkdir()
        self.names = list(names)
        self.fields = FieldsWriter(self.dir, filter_fields, field_types)
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
        id_blob, id_off = pack_ids(ids)
        payload_blob = b"".join(payloads)
        self._ids.write(id_blob)
        self._payloads.write(payload_blob)
        id_ends = self._id_end + id_off[1:]
        pl_ends = self._payload_end + np.cumsum(
            np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        )
        if len(ids):
            self._id_end, self._payload_end = int(id_ends[-1]), int(pl_ends[-1])
        self._ids_off.append(id_ends)
        self._payloads_off.append(pl_ends)
        self._presence.append(np.asarray(presence, dtype=bool).reshape(len(ids), len(self.names)))
        self._hashes.append(ID_HASHES[ID_HASH_KIND][1](id_blob, id_off))
        self.fields.append(payloads)
        self.rows += len(ids)

    def close(self) -> None:
        if self._ids.closed:
            return
        for f in (self._ids, self._payloads):
            f.flush()
            start_writeback(f.fileno())  # made durable by the publish (see arrays.Appender)
            f.close()
        for a in (self._ids_off, self._payloads_off, self._presence):
            a.close()
        hashes = np.concatenate(self._hashes) if self._hashes else np.zeros(0, np.uint64)
        order = id_order(hashes)
        np.save(self.dir / ID_HASH, hashes[order])
        np.save(self.dir / ID_ROW, order.astype(np.int64))
        self._hashes.clear()
        self.fields_info = self.fields.close()


def id_order(hashes: np.ndarray) -> np.ndarray:
    """The rows in the order of their id hashes, equal hashes in row order (a stable sort's
    order). numpy's default sort is several times faster than its stable one on 64-bit keys and
    only differs on equal hashes, which 64 bits make all but absent; where there are some, the
    stable one."""
    order = np.argsort(hashes)
    ordered = hashes[order]
    if len(ordered) > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        order = np.argsort(hashes, kind="stable")
    return order


CHECK_ROWS = 8192  # rows checked at once by RecordStore.problems


def _not_objects(blob: bytes, offsets: np.ndarray) -> int | None:
    """The first of the payloads packed in `blob` that is not a JSON object, or None: one
    msgspec call for all of them when object_lines can read them, else one by one."""
    n = len(offsets) - 1
    if n and object_lines(blob, offsets) is not None:
        return None
    bounds = offsets.tolist()
    for i in range(n):
        try:
            if not isinstance(orjson.loads(blob[bounds[i] : bounds[i + 1]]), dict):
                return i
        except orjson.JSONDecodeError:
            return i
    return None


_OBJECTS = msgspec.json.Decoder(dict[str, Any])


def object_lines(blob: bytes, offsets: np.ndarray) -> list[dict[str, Any]] | None:
    """The JSON objects packed in `blob` (item i at blob[offsets[i]:offsets[i + 1]]) parsed by
    one msgspec call, or None when that cannot vouch for every item (the caller then looks at
    them one by one).

    The items are read as JSON Lines, which holds when each is one line that starts with `{`
    and ends with `}` (compact JSON objects, what the store holds, always are). Those lines are
    then exactly the items: at every line break the parser has just closed a brace and next
    sees an opening one, legal only outside every object, and a string cannot span a line; so
    n objects from n such lines are one per line."""
    n = len(offsets) - 1
    data = np.frombuffer(blob, dtype=np.uint8)
    starts, ends = offsets[:-1], offsets[1:]
    if not n or blob.find(b"\n") >= 0 or not bool((ends > starts).all()):
        return None
    if not (bool((data[starts] == ord("{")).all()) and bool((data[ends - 1] == ord("}")).all())):
        return None
    try:
        objs = _OBJECTS.decode_lines(joined(blob, offsets, b"\n"))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return objs if len(objs) == n else None


def joined(blob: bytes, offsets: np.ndarray, sep: bytes) -> bytes:
    """The packed items with the one-byte `sep` between them: b"".join of the items with sep,
    built by numpy instead of a Python slice per item."""
    n = len(offsets) - 1
    data = np.frombuffer(blob, dtype=np.uint8)
    out = np.full(len(data) + max(n - 1, 0), sep[0], dtype=np.uint8)
    out[np.arange(len(data)) + np.repeat(np.arange(n), np.diff(offsets))] = data  # item i: i right
    return out.tobytes()


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
        id_hash: str = ID_HASH_KIND,
    ):
        d = vdir / DIR
        self.names = list(names)
        self._hash_one, self._hash_packed = ID_HASHES[id_hash]  # the manifest names it
        try:
            self._ids = _map_bytes(d / IDS)
            self._payloads = _map_bytes(d / PAYLOADS)
            # plain views of the maps: np.memmap's own item access costs a microsecond a call,
            # and a response's ids and payloads take four each
            self._ids_off = np.load(d / IDS_OFF, mmap_mode="r").view(np.ndarray)
            self._payloads_off = np.load(d / PAYLOADS_OFF, mmap_mode="r").view(np.ndarray)
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
        raw = record_id.encode("utf-8")
        h = np.uint64(self._hash_one(raw))
        lo = int(np.searchsorted(self._hash, h, side="left"))
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
        ids_off, pl_off = np.asarray(self._ids_off), np.asarray(self._payloads_off)
        for start in range(0, n, CHECK_ROWS):
            stop = min(start + CHECK_ROWS, n)
            at = ids_off[start : stop + 1]
            got = self._hash_packed(self._ids[int(at[0]) : int(at[-1])], at - at[0])
            wrong = np.flatnonzero(hashes[position[start:stop]] != got)
            if len(wrong):
                return [*out, f"{DIR}/{ID_HASH}: row {start + int(wrong[0])}'s id is not indexed"]
            at = pl_off[start : stop + 1]
            bad = _not_objects(self._payloads[int(at[0]) : int(at[-1])], at - at[0])
            if bad is not None:
                return [*out, f"{DIR}/{PAYLOADS}: row {start + bad}'s payload is not an object"]
        return out

    def close(self) -> None:
        for m in (self._ids, self._payloads):
            if isinstance(m, mmap.mmap):
                m.close()
