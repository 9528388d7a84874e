"""JSON Lines records whose modalities are all fixed-length vectors, read without a Python
object per number: msgspec checks each line's shape (known keys, a string id) and keeps the
payload as its raw JSON, and pyarrow's JSON reader reads the vectors of a whole chunk into
Arrow lists, which indexer.ingest.checks then checks as it checks Parquet columns.

This path only decides what is plainly valid: a line msgspec refuses is a suspect, for the
reference path to accept or name, and a chunk pyarrow cannot read whole (a string or a nested
list where a vector should be) goes to the reference path entirely. Neither changes an answer,
only its speed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

EMPTY = msgspec.Raw(b"")


@dataclass
class ParsedLines:
    """One chunk of lines: per line an id (None if refused) and the payload's raw JSON (b"" if
    absent); per modality an Arrow list column (null where absent); and the refused lines."""

    ids: list[str | None]
    payloads: list[bytes]
    columns: dict[str, Any]
    suspect: np.ndarray


class VectorLines:
    def __init__(self, names: list[str]):
        import pyarrow as pa  # only constructed where pyarrow is installed (see available())
        import pyarrow.json as pjson

        self.names = names
        fields: list[tuple[str, Any, Any]] = [("payload", msgspec.Raw, EMPTY)]
        fields += [(name, msgspec.Raw, EMPTY) for name in names]
        # Unknown keys fail the line (the reference names them); so does an id of any other
        # type, or none.
        record = msgspec.defstruct(
            "Record", [("id", str), *fields], forbid_unknown_fields=True, kw_only=True
        )
        self.decode = msgspec.json.Decoder(record).decode
        schema = pa.schema([(name, pa.list_(pa.float64())) for name in names])
        self.read_options = pjson.ReadOptions(use_threads=False, block_size=1 << 30)
        self.parse_options = pjson.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore"
        )
        self.pa, self.pjson = pa, pjson

    @staticmethod
    def available() -> bool:
        try:
            import pyarrow.json  # noqa: F401
        except ImportError:
            return False
        return True

    def parse(self, lines: list[bytes]) -> ParsedLines | None:
        """None when pyarrow cannot read the chunk's vectors as lists of numbers."""
        n = len(lines)
        suspect = np.zeros(n, dtype=bool)
        ids: list[str | None] = [None] * n
        payloads = [b""] * n
        decode = self.decode
        for i, line in enumerate(lines):
            try:
                rec = decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                suspect[i] = True
                continue
            ids[i], payloads[i] = rec.id, bytes(rec.payload)
        blob = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines)
        try:
            table = self.pjson.read_json(
                io.BytesIO(blob), read_options=self.read_options, parse_options=self.parse_options
            )
        except (self.pa.ArrowInvalid, self.pa.ArrowTypeError, self.pa.ArrowNotImplementedError):
            return None
        if table.num_rows != n:
            return None
        columns = {name: table.column(name).combine_chunks() for name in self.names}
        return ParsedLines(ids, payloads, columns, suspect)
