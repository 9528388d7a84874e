"""The local engine: read, check, admit, encode and write a version's rows on this machine.

Reader processes check chunks ahead of the encoder (indexer.build.readahead); this process
admits them in input order (indexer.ingest.admission: duplicate ids, the first bad record) and
encodes the admitted rows with torch; the writer's thread (indexer.build.writer) appends them
to the version. Bounded queues between them keep memory to a few chunks whatever the input.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass

import torch

from indexer.build.encode import encode_rows
from indexer.build.readahead import ahead
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.checks import Checked, ChunkChecker
from indexer.ingest.sources import CHUNK_ROWS, Chunk, RecordFiles
from indexer.ingest.validate import Rows
from models.encoders import decoded_bytes
from models.machine import usable_cores
from models.model import MultimodalModel
from models.progress import Progress

AHEAD_PER_READER = 2  # chunks in flight per reader process
# Decoded inputs per chunk: images and clips of real towers are ~1 MB a record, so a chunk of
# CHUNK_ROWS of them would be GBs in each reader and again in this process.
CHUNK_BYTES = 64 * 1024 * 1024


def chunk_rows_for(model: MultimodalModel, batch_size: int, chunk_rows: int) -> int:
    """Records per chunk: `chunk_rows`, or fewer where the decoded inputs would exceed
    CHUNK_BYTES, in whole batches (a partial batch per chunk would waste encoder calls)."""
    sizes = [decoded_bytes(model.cfg.modalities[n]) for n in model.names]
    known = [s for s in sizes if s is not None]
    if not known:
        return max(chunk_rows, batch_size)
    fit = CHUNK_BYTES // max(1, sum(known))
    return max(batch_size, min(chunk_rows, fit // batch_size * batch_size))


def default_readers(n_cores: int) -> int:
    """Reader processes for a machine of `n_cores`: a quarter of them, at least one (checking
    costs a fraction of encoding, even for the cheapest encoders)."""
    return max(1, n_cores // 4)


@dataclass
class CheckedChunk:
    checked: Checked
    records: int  # records the chunk held, valid or not
    # Modalities whose decoded inputs (torch tensors) crossed the reader's pipe as numpy arrays:
    # torch's own pickling of a tensor shares it through its shared-memory manager, which can
    # hang in a process forked while the parent's torch threads run (seen with 2 torch threads).
    as_numpy: tuple[str, ...] = ()

    def tensors_back(self) -> Rows:
        rows = self.checked.rows
        for name in self.as_numpy:
            rows.inputs[name] = [None if x is None else torch.from_numpy(x)
                                 for x in rows.inputs[name]]  # fmt: skip
        return rows


class _Check:
    """A picklable `chunk -> CheckedChunk` for the reader processes (they inherit it)."""

    def __init__(self, checker: ChunkChecker):
        self.checker = checker

    def __call__(self, chunk: Chunk) -> CheckedChunk:
        checked = self.checker.check(chunk)
        inputs = checked.rows.inputs
        tensors = tuple(
            n for n, v in inputs.items()
            if isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v)
        )  # fmt: skip
        for n in tensors:
            inputs[n] = [None if x is None else x.numpy() for x in inputs[n]]
        return CheckedChunk(checked, len(chunk), tensors)


def encode_local(
    model: MultimodalModel,
    files: RecordFiles,
    checker: ChunkChecker,
    admission: Admission,
    writer: RowWriter,
    batch_size: int,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool = True,
    readers: int | None = None,
) -> int:
    """Check, admit, encode and write every record of `files`, `chunk_rows` checked at once
    and `batch_size` per encoder call; returns the rows written. The records left out join
    `admission.rejected`. `readers`: reader processes (default: from the cores; 0 checks here).
    torch keeps the cores the readers leave, unless its thread count was set (OMP_NUM_THREADS)."""
    n_readers = default_readers(usable_cores()) if readers is None else readers
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() - n_readers))
    chunks: Generator[CheckedChunk, None, None] = ahead(
        _Check(checker), files.chunks(chunk_rows), n_readers, AHEAD_PER_READER * n_readers
    )
    bar = Progress(desc="encode", unit="rec", disable=not progress)
    before = writer.rows
    try:
        for chunk in chunks:
            keep = admission.admit(chunk.checked)
            write_admitted(model, chunk.tensors_back().take(keep), writer, batch_size)
            bar.update(chunk.records)
        writer.drain()
    finally:
        chunks.close()
        bar.close()
    return writer.rows - before


def write_admitted(model: MultimodalModel, rows: Rows, writer: RowWriter, batch_size: int) -> None:
    """Encode the rows here; write them on the writer's thread."""
    if len(rows):
        writer.write_rows(
            rows.ids, rows.payloads, rows.presence, encode_rows(model, rows, batch_size)
        )
