"""Training tuples read lazily from a JSON Lines file through a byte-offset index of its lines.

`RecordsFile.scan` reads the file once. It parses every line and checks what is cheap to check
(ids present and unique, modalities known and all present, vectors, embeddings and texts
decodable) and keeps 16 bytes per record: the byte span of its line. Images, audio and plugin
inputs are decoded only when a batch is read, in whichever process reads it (the DataLoader's
workers), so memory does not grow with the dataset. A bad media file stops the run at the batch
that holds it, with the line and id like any other bad record.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModelConfig
from models.encoders import decode
from models.limits import DEFAULT_LIMITS, InputError, InputLimits
from models.records import BadLines, RecordError, display_path, parse_line, record_id
from models.train.data import IgnoredFields, check_modalities, input_key

# Decoding these costs about as much as the JSON parse, so the scan checks them all up front.
CHEAP_KINDS = ("vector", "embedding", "text")


def _scan_line(
    line: bytes,
    line_no: int,
    cfg: ModelConfig,
    base_dir: Path,
    limits: InputLimits,
    ignored: IgnoredFields,
) -> str:
    """The id of a line the scan accepts, after the checks that are cheap to make."""
    obj = parse_line(line, line_no)
    rid = record_id(obj, line_no)
    ignored.add(check_modalities(obj, cfg, line_no, rid), line_no)
    for name in cfg.names:
        m = cfg.modalities[name]
        if m.kind in CHEAP_KINDS:
            try:
                decode(obj[name], m, base_dir, limits)
            except InputError as exc:
                raise RecordError(f"{name}: {exc}", line_no, rid) from None
    return rid


def _id_hash(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode("utf-8"), digest_size=8).digest(), "little")


class RecordsFile:
    """A records file as a sequence of training tuples, decoded on demand."""

    def __init__(
        self, path: Path, cfg: ModelConfig, spans: np.ndarray, limits: InputLimits = DEFAULT_LIMITS
    ):
        self._fd: int | None = None
        self.path = path
        self.cfg = cfg
        self.limits = limits  # its media_root: where media paths may lead
        self.spans = spans  # (N, 2) int64: [start, end) byte offsets of each record's line
        st = path.stat()
        self._stamp = (st.st_size, st.st_mtime_ns)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # a spawned worker opens the file itself

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    @staticmethod
    def scan(
        path: str | Path, cfg: ModelConfig, limits: InputLimits = DEFAULT_LIMITS
    ) -> RecordsFile:
        path = Path(path)
        if not path.is_file():
            raise RecordError(f"records file not found: {path}")
        spans, hashes = array("q"), array("Q")
        bad, ignored = BadLines(display_path(path)), IgnoredFields()
        offset = 0
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    rid = _scan_line(line, line_no, cfg, path.parent, limits, ignored)
                except RecordError as exc:  # every bad line is named, up to a limit
                    bad.add(exc)
                    continue
                spans.extend((start, offset))
                hashes.append(_id_hash(rid))
        if not hashes and not bad:
            raise RecordError(f"{path}: no records")
        spans_2d = np.frombuffer(spans, dtype=np.int64).reshape(-1, 2)
        records = RecordsFile(path, cfg, spans_2d, limits)
        records._check_unique_ids(np.frombuffer(hashes, dtype=np.uint64), bad)
        ignored.report(cfg)
        bad.raise_any()
        return records

    def _check_unique_ids(self, hashes: np.ndarray, bad: BadLines) -> None:
        """Ids are compared by 64-bit hash (8 bytes a record, not a set of strings); a repeat is
        confirmed on the ids themselves and joins `bad` at each repetition in the file."""
        order = np.argsort(hashes, kind="stable")
        sorted_h = hashes[order]
        repeats = np.flatnonzero(sorted_h[1:] == sorted_h[:-1]) + 1  # positions in sorted order
        for pos in repeats[np.argsort(order[repeats], kind="stable")]:
            later = int(order[pos])
            rid = self._id(later)
            group = int(np.searchsorted(sorted_h, sorted_h[pos], side="left"))
            for earlier in order[group:pos]:
                if self._id(int(earlier)) == rid:
                    first = self.line_of(int(earlier))
                    bad.add(
                        RecordError(
                            f"duplicate id, first seen on line {first}", self.line_of(later), rid
                        )
                    )
                    break

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def _read(self, i: int) -> dict[str, Any]:
        start, end = (int(v) for v in self.spans[i])
        # pread: forked workers share the descriptor but never a file position.
        raw = os.pread(self._file(), end - start, start)
        try:
            return parse_line(raw, 0)
        except RecordError as exc:  # the scan parsed it, so the file changed under us
            raise RecordError(exc.reason, self.line_of(i), exc.record_id) from None

    def _id(self, i: int) -> str:
        return str(self._read(i)["id"])

    def id_of(self, i: int) -> str:
        """Record i's id (read from its line again: ids are not kept in memory)."""
        return self._id(i)

    def line_of(self, i: int) -> int:
        """The 1-based line number of record i, counted only when a message needs it."""
        fd, target, done, newlines = self._file(), int(self.spans[i, 0]), 0, 0
        while done < target:
            chunk = os.pread(fd, min(1 << 20, target - done), done)
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            done += len(chunk)
        return newlines + 1

    def _check_unchanged(self) -> None:
        st = os.fstat(self._file())
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise RecordError(f"{self.path}: the records file changed while training read it")

    def batch(self, index: Sequence[int]) -> tuple[dict[str, list[Any]], dict[str, torch.Tensor]]:
        """Decoded inputs and duplicate-detection keys of the records at `index`, in order."""
        self._check_unchanged()
        items: dict[str, list[Any]] = {n: [] for n in self.cfg.names}
        for i in index:
            obj = self._read(i)
            for name in self.cfg.names:
                try:
                    cfg = self.cfg.modalities[name]
                    x = decode(obj[name], cfg, self.path.parent, self.limits)
                except InputError as exc:
                    raise RecordError(f"{name}: {exc}", self.line_of(i), obj.get("id")) from None
                items[name].append(x)
        keys = {
            n: torch.tensor([input_key(x) for x in v], dtype=torch.int64) for n, v in items.items()
        }
        return items, keys
