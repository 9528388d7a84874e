"""Reading JSON Lines records (docs/design.md §3) as a stream, with errors that name the line
and id."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Iterator
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


# Bad records a run names at once without --skip-bad: enough to fix a file in one pass, few
# enough that a file of nothing but bad lines stops early.
MAX_REPORTED = 20


def display_path(path: str | Path) -> str:
    """How every command names a file: relative to the working directory when inside it (as
    a user types it), else absolute."""
    full = Path(os.path.abspath(path))
    try:
        return str(full.relative_to(Path.cwd()))
    except ValueError:
        return str(full)


class BadRecords(RecordError):
    """Every bad record one run found (up to MAX_REPORTED), named one per line."""

    def __init__(
        self, errors: list[RecordError], file: str | None, stopped: bool, skip: str | None
    ):
        first = errors[0]
        super().__init__(first.reason, first.line, first.record_id, file)
        count = f"the first {len(errors)}" if stopped else str(len(errors))
        head = f"{file}: " if file is not None else ""
        fix = f"fix them, or pass {skip} to leave them out" if skip else "fix them"
        stop = " (checking stopped there)" if stopped else ""
        lines = [f"{head}{count} bad records{stop}; {fix}:"]
        lines += [f"  {exc}" for exc in errors]
        self.args = ("\n".join(lines),)
        self.errors = errors


class BadLines:
    """A run's bad records, kept so that one run names them all: `add` each one (it raises once
    MAX_REPORTED are kept), then `raise_any` at the end."""

    def __init__(self, file: str | None = None, skip: str | None = None, limit: int = MAX_REPORTED):
        self.file = file
        self.skip = skip  # the option that leaves bad records out, if the command has one
        self.limit = limit
        self.errors: list[RecordError] = []

    def __bool__(self) -> bool:
        return bool(self.errors)

    def add(self, exc: RecordError) -> None:
        self.errors.append(exc)
        if len(self.errors) >= self.limit:
            raise self._error(stopped=True)

    def raise_any(self) -> None:
        if self.errors:
            raise self._error(stopped=False)

    def _error(self, stopped: bool) -> RecordError:
        self.errors.sort(key=lambda e: e.line if e.line is not None else 0)
        first = self.errors[0]
        if len(self.errors) == 1 and not stopped:
            return first if self.file is None else first.in_file(self.file)
        if len({e.reason for e in self.errors}) == 1 and all(e.line for e in self.errors):
            # One mistake on many lines (a file made for another model): said once.
            lines = ", ".join(str(e.line) for e in self.errors)
            more = " and maybe more (checking stopped there)" if stopped else ""
            head = f"{self.file}: " if self.file is not None else ""
            exc = RecordError(first.reason, first.line, first.record_id, self.file)
            exc.args = (f"{head}lines {lines}{more}: {first.reason}",)
            return exc
        return BadRecords(self.errors, self.file, stopped, self.skip)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of `choices` that `word` is a near-miss of (a typo), if any."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.7)
    return close[0] if close else None


def near_miss(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a near-miss of one of `choices`, else ''."""
    close = closest(word, choices)
    return f" (did you mean {close!r}?)" if close else ""


def ignored_line(ignored: dict[str, str], names: list[str]) -> str:
    """The one line a command says about record fields it left out: each name, where it
    first appeared, and a modality it is a near-miss of."""
    parts = [f"{k!r} (first on {where}){near_miss(k, names)}" for k, where in ignored.items()]
    return f"ignored fields that are no modality of the model ({', '.join(names)}): " + ", ".join(
        parts
    )


def _open_at_end(text: str) -> tuple[int, int | None]:
    """(brackets still open, column where an unclosed string starts or None) at the end of
    `text`: a line cut short leaves one or the other."""
    depth, string_start, escaped = 0, None, False
    for col, ch in enumerate(text, start=1):
        if string_start is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                string_start = None
        elif ch == '"':
            string_start = col
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return depth, string_start


def _json_problem(text: str, exc: json.JSONDecodeError) -> str:
    """What is wrong, and where: the end of a line cut short, else where the parser stopped."""
    body = text.rstrip("\r\n")
    depth, string_start = _open_at_end(body)
    end = len(body)
    if string_start is not None:
        return (
            f"not valid JSON: the line ends at column {end} inside a string that starts at "
            f"column {string_start} (is it cut short?)"
        )
    if depth > 0 and exc.pos >= len(body.rstrip()) - 1:
        return (
            f"not valid JSON: the line ends at column {end} with {depth} bracket"
            f"{'s' if depth > 1 else ''} still open (is it cut short?)"
        )
    what = exc.msg.removesuffix(" at")  # "Invalid control character at"
    return f"not valid JSON at column {exc.colno} ({what})"


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
            raise RecordError(_json_problem(text, exc), line_no) from None
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
