"""The local engine: read, check, encode and write a version's rows on this machine.

Two cores at work: a reader (indexer.prefetch: a forked child process, or a thread) reads
chunks and checks them (indexer.columnar), while this process admits them in order
(indexer.ordering), encodes them and appends them to the version. A bounded queue between
the two keeps memory to a few chunks.
"""

from __future__ import annotations

from tqdm import tqdm

from indexer.columnar import Checked, ChunkChecker
from indexer.encode import RowWriter, encode_rows
from indexer.ordering import Admission
from indexer.prefetch import ahead
from indexer.sources import CHUNK_ROWS, RecordFiles
from models.model import MultimodalModel

AHEAD = 2  # chunks checked ahead of the encoder


def encode_local(
    model: MultimodalModel,
    files: RecordFiles,
    checker: ChunkChecker,
    admission: Admission,
    writer: RowWriter,
    batch_size: int,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool = True,
) -> int:
    """Check, admit, encode and write every record of `files`, `chunk_rows` checked at once
    and `batch_size` per encoder call; returns the rows written."""
    checked = ahead(lambda: (checker.check(c) for c in files.chunks(chunk_rows)), AHEAD)
    bar = tqdm(desc="encode", unit="rec", disable=not progress)
    written = 0
    try:
        for chunk in checked:
            written += write_checked(model, chunk, admission, writer, batch_size)
            bar.update(len(chunk.rows) + len(chunk.rejects))
    finally:
        checked.close()
        bar.close()
    return written


def write_checked(
    model: MultimodalModel,
    checked: Checked,
    admission: Admission,
    writer: RowWriter,
    batch_size: int,
) -> int:
    rows = checked.rows.take(admission.admit(checked))
    if len(rows):
        embs = encode_rows(model, rows, batch_size)
        writer.write_rows(rows.ids, rows.payloads, rows.presence, embs)
    return len(rows)
