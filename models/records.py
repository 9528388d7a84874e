"""Reading JSON Lines records (DESIGN §3) as a stream, with errors that name the line and id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class RecordError(ValueError):
    """A record is malformed; the message names its line and id."""

    def __init__(self, message: str, line: int | None = None, record_id: str | None = None):
        where = []
        if line is not None:
            where.append(f"line {line}")
        if record_id is not None:
            where.append(f"id {record_id!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.line = line
        self.record_id = record_id
        self.reason = message


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) for every non-blank line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"records file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                # NaN and Infinity are not JSON; refuse them here rather than index them.
                obj = json.loads(line, parse_constant=_reject_constant)
            except (json.JSONDecodeError, ValueError) as exc:
                raise RecordError(f"not valid JSON ({exc})", line=line_no) from None
            if not isinstance(obj, dict):
                raise RecordError("expected a JSON object", line=line_no)
            yield line_no, obj


def record_id(obj: dict[str, Any], line: int) -> str:
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise RecordError("'id' must be a non-empty string", line=line)
    return rid
