"""Record sources: JSON Lines or Parquet, one file or a directory or glob of shards.

Two ways to read them:
- per record (`iter_records`): (line or row number, raw record), the reference path the
  Validator checks one by one;
- in chunks (`RecordFiles.chunks`): (locations, raw lines) for JSON Lines and (locations, an
  Arrow record batch) for Parquet, for the columnar checks of indexer.ingest.checks. Parquet is read
  by pyarrow straight into Arrow arrays: vector columns never become Python objects.

A location names a record's file and its line (JSON Lines; blank lines count) or 1-based row
(Parquet) in one int: `file index << LINE_BITS | line`. With one file the location is the line
number itself, so single-file messages read exactly as they always have.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.extras import require
from models.records import RecordError

# What a source yields per record: a line's bytes (JSON Lines), a row's fields (Parquet), or
# why it could not even be read as a record.
RawRecord = bytes | dict[str, Any] | RecordError

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
LINE_BITS = 40  # a trillion lines per file; 2^23 files
CHUNK_ROWS = 8192  # records per chunk: big enough for numpy to pay off, small for memory


def pack(file_index: int, line: int) -> int:
    return (file_index << LINE_BITS) | line


def unpack(loc: int) -> tuple[int, int]:
    return loc >> LINE_BITS, loc & ((1 << LINE_BITS) - 1)


@dataclass(frozen=True)
class RecordFiles:
    """The files of one input, in the order their records take in the version."""

    files: tuple[Path, ...]
    parquet: bool

    @classmethod
    def resolve(cls, spec: str | Path) -> RecordFiles:
        """FILE, DIR (its JSON Lines or Parquet files, sorted by name) or GLOB (sorted)."""
        path = Path(spec)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(
                p
                for p in path.iterdir()
                if p.is_file() and p.suffix.lower() in PARQUET_SUFFIXES + JSONL_SUFFIXES
            )
            if not files:
                raise RecordError(f"no .jsonl or .parquet records files in directory {path}")
        elif glob.has_magic(str(spec)):
            files = sorted(Path(p) for p in glob.glob(str(spec)) if Path(p).is_file())
            if not files:
                raise RecordError(f"no records files match {spec}")
        else:
            raise RecordError(f"records file not found: {path}")
        kinds = {p.suffix.lower() in PARQUET_SUFFIXES for p in files}
        if len(kinds) > 1:
            raise RecordError(f"{spec}: mixes Parquet and JSON Lines files; use one format")
        return cls(tuple(files), kinds.pop())

    @property
    def base_dir(self) -> Path:
        """Media paths in records are relative to their file's directory (one for all here:
        a glob over several directories resolves paths against the first file's)."""
        return self.files[0].parent

    def where(self, loc: int) -> str:
        """`line 3`, or with several files `line 3 of part-1.jsonl`."""
        index, line = unpack(loc)
        return (
            f"line {line}" if len(self.files) == 1 else f"line {line} of {self.files[index].name}"
        )

    def file_name(self, loc: int) -> str | None:
        return None if len(self.files) == 1 else self.files[unpack(loc)[0]].name

    def chunks(self, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        for index, path in enumerate(self.files):
            if self.parquet:
                yield from parquet_chunks(path, index, rows)
            else:
                yield from jsonl_chunks(path, index, rows)

    def iter_records(self) -> Iterator[tuple[int, RawRecord]]:
        for index, path in enumerate(self.files):
            for line, raw in iter_records(path):
                yield pack(index, line), raw


@dataclass
class Chunk:
    """Consecutive records of one file: `locs` (n,) int64, and either `lines` (the JSON Lines'
    bytes) or `table` (a pyarrow RecordBatch of the Parquet rows)."""

    locs: np.ndarray
    lines: list[bytes] | None = None
    table: Any = None

    def __len__(self) -> int:
        return len(self.locs)


def jsonl_chunks(path: Path, file_index: int, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
    """Non-blank lines, `rows` at a time, with their line numbers (blank lines count)."""
    base = pack(file_index, 0)
    locs: list[int] = []
    lines: list[bytes] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                locs.append(base + line_no)
                lines.append(line)
                if len(lines) == rows:
                    yield Chunk(np.asarray(locs, dtype=np.int64), lines=lines)
                    locs, lines = [], []
    if lines:
        yield Chunk(np.asarray(locs, dtype=np.int64), lines=lines)


def open_parquet(path: Path) -> Any:
    pq = require("pyarrow.parquet", "parquet", "reading Parquet records")
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise RecordError(f"{path}: not a readable Parquet file ({exc})") from None


def parquet_chunks(
    path: Path, file_index: int, rows: int = CHUNK_ROWS, row_groups: list[int] | None = None
) -> Iterator[Chunk]:
    """Record batches with their 1-based row numbers; `row_groups` reads only those (the Ray
    engine splits a file by row groups), numbered as in the whole file."""
    pf = open_parquet(path)
    groups = list(range(pf.num_row_groups)) if row_groups is None else row_groups
    starts = np.concatenate(
        [[0], np.cumsum([pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])]
    )
    for g in groups:
        first = int(starts[g]) + 1
        for batch in pf.iter_batches(batch_size=rows, row_groups=[g]):
            locs = pack(file_index, first) + np.arange(batch.num_rows, dtype=np.int64)
            first += batch.num_rows
            yield Chunk(locs, table=batch)


def parquet_record(obj: dict[str, Any], row: int) -> RawRecord:
    """A Parquet row's fields as a record. Parquet has no "absent": a null column value means
    the record lacks that modality; a string payload holds the payload's JSON."""
    rec = {k: v for k, v in obj.items() if v is not None}
    if isinstance(rec.get("payload"), str):
        try:
            rec["payload"] = json.loads(rec["payload"], parse_constant=_no_constant)
        except ValueError:
            rid = rec.get("id") if isinstance(rec.get("id"), str) else None
            return RecordError("payload: a string payload must hold a JSON object", row, rid)
    return rec


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parquet_rows(path: Path, batch_rows: int = 1024) -> Iterator[tuple[int, RawRecord]]:
    pf = open_parquet(path)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for obj in batch.to_pylist():
            row += 1
            yield row, parquet_record(obj, row)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, RawRecord]]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, line


def iter_records(path: str | Path) -> Iterator[tuple[int, RawRecord]]:
    """One file, record by record: line numbers for JSON Lines, 1-based rows for Parquet."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"records file not found: {path}")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    return _jsonl_lines(path)
