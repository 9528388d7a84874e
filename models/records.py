"""Reading JSON Lines records (docs/design.md §3) as a stream, with errors that name the line
and id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from models.limits import string_problem


class RecordError(ValueError):
    """A record is malformed; the message names its line and id."""

    def __init__(
        self,
        message: str,
        line: int | None = None,
        record_id: str | None = None,
        file: str | None = None,
    ):
        if record_id is not None and not record_id.isascii():
            # A lone surrogate, written as its escape: the message and the rejected list print.
            record_id = record_id.encode("utf-8", "backslashreplace").decode("utf-8")
        where = [file] if file is not None else []
        if line is not None:
            where.append(f"line {line}")
        if record_id is not None:
            where.append(f"id {record_id!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.line = line
        self.record_id = record_id
        self.reason = message
        self.file = file

    def in_file(self, file: str) -> RecordError:
        """The same error, naming the file it is in (a command's one line names it)."""
        if self.file is not None or self.line is None:  # named already, or not about a line
            return self
        return RecordError(self.reason, self.line, self.record_id, file)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _lenient_id(line: str) -> str | None:
    """The id of a line that Python's lenient parser accepts, to name it in an error."""
    obj = json.loads(line)
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def parse_line(line: str | bytes, line_no: int) -> dict[str, Any]:
    """One JSON Lines record. orjson parses floats several times faster than the standard
    library and refuses NaN and Infinity; the standard library then names the failure."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            what = exc.msg.removesuffix(" at")  # "Invalid control character at"
            raise RecordError(f"not valid JSON at column {exc.colno} ({what})", line_no) from None
        except ValueError as exc:  # NaN or Infinity, which are not JSON
            raise RecordError(f"not valid JSON ({exc})", line_no, _lenient_id(text)) from None
    if not isinstance(obj, dict):
        raise RecordError("expected a JSON object", line=line_no)
    return obj


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) for every non-blank line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"records file not found: {path}")
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, parse_line(line, line_no)


def record_id(obj: dict[str, Any], line: int | None) -> str:
    """The record's id: a non-empty string that can be stored and looked up exactly."""
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise RecordError("'id' must be a non-empty string", line=line)
    problem = string_problem(rid)
    if problem is not None:
        raise RecordError(f"'id' {problem}", line, rid)
    return rid
