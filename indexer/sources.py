"""Record sources: JSON Lines or Parquet, read as a stream of (line or row number, raw record).

A raw record is a line's bytes (parsed by the Validator, so that a line that is not JSON is a
bad record like any other) or a Parquet row's fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from indexer.encode import RawRecord
from models.extras import require
from models.records import RecordError

PARQUET_SUFFIXES = (".parquet", ".pq")


def _parquet_rows(path: Path, batch_rows: int = 1024) -> Iterator[tuple[int, RawRecord]]:
    pq = require("pyarrow.parquet", "parquet", "reading Parquet records")

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise RecordError(f"{path}: not a readable Parquet file ({exc})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for obj in batch.to_pylist():
            row += 1
            yield row, _parquet_record(obj, row)


def _parquet_record(obj: dict[str, Any], row: int) -> RawRecord:
    # Parquet has no "absent": a null column value means the record lacks that modality.
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


def _jsonl_lines(path: Path) -> Iterator[tuple[int, RawRecord]]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, line


def iter_records(path: str | Path) -> Iterator[tuple[int, RawRecord]]:
    """Line numbers for JSON Lines, 1-based row numbers for Parquet."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"records file not found: {path}")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    return _jsonl_lines(path)
