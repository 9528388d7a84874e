"""The local engine: read, check, encode and write a version's rows on this machine.

Two cores at work: a reader (indexer.prefetch: a forked child process, or a thread) reads
chunks and checks them (indexer.columnar); this process's main thread does nothing but encode
them; the writer's thread (indexer.encode.RowWriter) admits them in order (indexer.ordering)
and appends them to the version. Bounded queues between the three keep memory to a few chunks.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from indexer.columnar import Checked, ChunkChecker
from indexer.encode import Batch, RowWriter, encode_rows
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
    before = writer.rows
    try:
        for chunk in checked:
            write_checked(model, chunk, admission, writer, batch_size)
            bar.update(len(chunk.rows) + len(chunk.rejects))
        writer.drain()
    finally:
        checked.close()
        bar.close()
    return writer.rows - before


def write_checked(
    model: MultimodalModel,
    checked: Checked,
    admission: Admission,
    writer: RowWriter,
    batch_size: int,
) -> None:
    """Encode the chunk's valid rows here; admit them (ids in input order: duplicates, the
    first bad record) and write them on the writer's thread, off the encoder's core. A row
    that admission leaves out (a duplicate id: rare) was encoded for nothing."""
    rows = checked.rows
    embs = encode_rows(model, rows, batch_size) if len(rows) else {}

    def admitted() -> Batch | None:
        keep = admission.admit(checked)
        if not keep.any():
            return None
        kept = rows.take(keep)
        idx = np.flatnonzero(keep)
        sub = embs if len(kept) == len(rows) else {n: e[idx] for n, e in embs.items()}
        return Batch(kept.ids, kept.payloads, kept.presence, sub)

    writer.write_later(admitted)
