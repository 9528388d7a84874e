"""Record sources: JSON Lines or Parquet, read as a stream of (line or row number, record)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from models.records import RecordError, iter_jsonl

PARQUET_SUFFIXES = (".parquet", ".pq")


def _parquet_rows(path: Path, batch_rows: int = 1024) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise RecordError(f"{path}: not a readable Parquet file ({exc})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for obj in batch.to_pylist():
            row += 1
            # Parquet has no "absent": a null column value means the record lacks that modality.
            rec = {k: v for k, v in obj.items() if v is not None}
            if isinstance(rec.get("payload"), str):
                try:
                    rec["payload"] = json.loads(rec["payload"])
                except json.JSONDecodeError:
                    raise RecordError(
                        "payload: a string payload must hold JSON", line=row
                    ) from None
            yield row, rec


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Line numbers for JSON Lines, 1-based row numbers for Parquet."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"records file not found: {path}")
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    return iter_jsonl(path)
