"""JSON Lines records whose modalities are all fixed-length vectors, parsed without a Python
object per number.

Kept for a measured gain (docs/benchmarks/indexing.md: a 1M-record JSON Lines build's encoding
phase, alternating runs, about a fifth shorter than with pyarrow's JSON reader): msgspec checks
each line's JSON and hands each modality's value back as its raw bytes (msgspec.Raw), and the
numbers of a whole chunk are converted at once by Arrow's CSV reader, in C (same doubles, both
round correctly).

This path only decides what is plainly valid. A line msgspec refuses (not JSON, an unknown
key, an id that is not a string) or a vector that is not a flat list of `dim` plain numbers
(strings, booleans, nulls inside, nested lists, whitespace, the wrong length) is returned as
a suspect, for indexer.ingest.checks' reference path to accept or name; so is every line of a
chunk that Arrow cannot convert as a whole. None of that changes an answer, only its speed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from indexer.ingest import arrow_numpy

EMPTY = msgspec.Raw(b"")


@dataclass
class ParsedLines:
    """One slice of lines: per line an id, the payload's raw JSON (b"" if absent) and, per
    modality, (n, dim) float64 values with (n,) presence; `suspect` lines hold nothing."""

    ids: list[str | None]
    payloads: list[bytes]
    vectors: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    suspect: np.ndarray


class VectorLines:
    """Parses lines of records whose every modality is a `dim`-long vector."""

    def __init__(self, dims: dict[str, int]):
        import pyarrow as pa  # only constructed where pyarrow is installed (see available())
        import pyarrow.csv as pcsv

        self.dims = dims
        fields: list[tuple[str, Any, Any]] = [("payload", msgspec.Raw, EMPTY)]
        fields += [(name, msgspec.Raw, EMPTY) for name in dims]
        # Unknown keys fail the line (the reference names them); so does an id of any other
        # type, or none.
        record = msgspec.defstruct(
            "Record", [("id", str), *fields], forbid_unknown_fields=True, kw_only=True
        )
        self.decode = msgspec.json.Decoder(record).decode
        self.blank: Any = self.decode(b'{"id": ""}')  # stands in for a line msgspec refused
        self.pcsv, self.pa = pcsv, pa

    @staticmethod
    def available() -> bool:
        try:
            import pyarrow.csv  # noqa: F401
        except ImportError:
            return False
        return True

    def parse(self, lines: list[bytes]) -> ParsedLines | None:
        """None when a vector of the chunk is anything but a flat list of plain numbers (or
        null): the caller parses the chunk otherwise, and names what is wrong."""
        n = len(lines)
        suspect = np.zeros(n, dtype=bool)
        recs: list[Any] = [None] * n
        decode = self.decode
        for i, line in enumerate(lines):
            try:
                recs[i] = decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                suspect[i] = True
        ok = [r if r is not None else self.blank for r in recs]
        ids: list[str | None] = [r.id if r is not None else None for r in recs]
        payloads = [bytes(r.payload) for r in ok]
        vectors, present = {}, {}
        for name, dim in self.dims.items():
            got = self._vectors([getattr(r, name) for r in ok], dim)
            if got is None:
                return None
            vectors[name], present[name] = got
        return ParsedLines(ids, payloads, vectors, present, suspect)

    def _vectors(self, raws: list[Any], dim: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(n, dim) float64 and (n,) presence from one modality's raw JSON values (b"" where
        the key is absent); None unless every value is null or a flat list of `dim` numbers.

        The checks run on all values joined, not value by value: msgspec has already checked
        that each is one JSON value, so a join with as many `[` and `]` as values, which
        Arrow's CSV reader reads as rows of `dim` numbers, is values that are each one flat
        list of numbers (a bare number has no bracket, a nested list more than one)."""
        n = len(raws)
        present = np.fromiter(map(len, raws), dtype=np.int64, count=n) > 0
        idx = np.flatnonzero(present)
        items = raws if len(idx) == n else [raws[i] for i in idx]
        joined = b"\n".join(items)
        if b"n" in joined:  # a null somewhere, which is absence, as for the reference
            null = np.fromiter((bytes(r) == b"null" for r in items), bool, count=len(items))
            present[idx[null]] = False
            idx, items = idx[~null], [items[j] for j in np.flatnonzero(~null)]
            joined = b"\n".join(items)
        out = np.zeros((n, dim), dtype=np.float64)
        if not items:
            return out, present
        # One `[` and one `]` a value; Arrow's reader refuses any token that is not a number
        # (quotes are no quotes to it, and no string is null), and a row without `dim` of them.
        if joined.count(b"[") != len(items) or joined.count(b"]") != len(items):
            return None
        values = self._convert(joined.translate(None, b"[]"), len(items), dim)
        if values is None:
            return None
        out[idx] = values
        return out, present

    def _convert(self, text: bytes, rows: int, dim: int) -> np.ndarray | None:
        """`rows` lines of `dim` comma-separated numbers as (rows, dim) float64, by Arrow's CSV
        reader; None if it finds anything else."""
        pa, pcsv = self.pa, self.pcsv
        names = [f"v{j}" for j in range(dim)]
        try:
            table = pcsv.read_csv(
                io.BytesIO(text),
                read_options=pcsv.ReadOptions(
                    column_names=names, use_threads=False, block_size=1 << 30
                ),
                parse_options=pcsv.ParseOptions(quote_char=False, ignore_empty_lines=False),
                convert_options=pcsv.ConvertOptions(
                    column_types={c: pa.float64() for c in names},
                    null_values=[],
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return None
        columns = [table.column(c) for c in names]
        if table.num_rows != rows or any(c.null_count for c in columns):
            return None
        return np.stack([arrow_numpy.numbers(c.combine_chunks()) for c in columns], axis=1)
