"""The local engine: read, check, admit, encode and write a version's rows on this machine.

Two cores at work: a reader (indexer.prefetch: a forked child process, or a thread) reads
chunks, checks them (indexer.columnar) and admits them in input order (indexer.ordering:
duplicate ids, the first bad record); this process's main thread does nothing but encode the
admitted rows; the writer's thread (indexer.encode.RowWriter) appends them to the version, on
the reader's core or the encoder's, whichever has time to spare (indexer.cores.WriterSide).
Bounded queues between the three keep memory to a few chunks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from indexer import cores
from indexer.columnar import ChunkChecker
from indexer.encode import Rejected, Rows, RowWriter, encode_rows
from indexer.ordering import Admission
from indexer.prefetch import ahead
from indexer.sources import CHUNK_ROWS, RecordFiles
from models.model import MultimodalModel

AHEAD = 2  # chunks checked ahead of the encoder


@dataclass
class Admitted:
    """A chunk after checking and admission: the rows that enter the version, the records it
    left out (with --skip-bad), and how many records the chunk held."""

    rows: Rows
    rejected: list[Rejected]
    records: int


def admitted_chunks(
    files: RecordFiles, checker: ChunkChecker, skip_bad: bool, chunk_rows: int
) -> Iterator[Admitted]:
    """Every chunk of `files`, checked and admitted in input order: the reader's work. It
    keeps an Admission of its own (a forked reader's updates would never reach the caller's),
    and raises the first bad record's RecordError unless skip_bad.

    Why admission here and not beside the encoder: it is a dict of every id so far, Python
    that holds the GIL (a resize rehashes every id at once), and beside the encoder it cost
    the encoding phase 0.2-0.8 s per 1M records (measured, 2-vCPU Xeon); the reader's core has
    time to spare."""
    admission = Admission(files, skip_bad)
    for chunk in files.chunks(chunk_rows):
        checked = checker.check(chunk)
        before = len(admission.rejected)
        keep = admission.admit(checked)
        yield Admitted(checked.rows.take(keep), admission.rejected[before:], len(chunk))


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
    and `batch_size` per encoder call; returns the rows written. The records left out join
    `admission.rejected`; the ids taken are those written, not `admission.seen`, which stays
    empty (see admitted_chunks)."""
    placement = cores.plan()
    others = placement.others if placement else None

    def read() -> Iterator[Admitted]:
        with cores.placed(others):  # the reader's thread, in the child or here
            yield from admitted_chunks(files, checker, admission.skip_bad, chunk_rows)

    chunks = ahead(read, AHEAD)
    writer.cpus = others
    side = cores.WriterSide(placement, writer.place) if placement else None
    bar = tqdm(desc="encode", unit="rec", disable=not progress)
    before = writer.rows
    try:
        with cores.placed(placement.encoder if placement else None):
            asked = time.perf_counter()  # for the next chunk
            for chunk in chunks:
                got = time.perf_counter()
                admission.rejected += chunk.rejected
                write_admitted(model, chunk.rows, writer, batch_size)
                bar.update(chunk.records)
                if side is not None:  # waited for this chunk, then worked on it
                    side.report(got - asked, time.perf_counter() - got)
                asked = time.perf_counter()
            writer.drain()
    finally:
        chunks.close()
        bar.close()
    return writer.rows - before


def write_admitted(model: MultimodalModel, rows: Rows, writer: RowWriter, batch_size: int) -> None:
    """Encode the rows here; write them on the writer's thread, off the encoder's core."""
    if len(rows):
        writer.write_rows(
            rows.ids, rows.payloads, rows.presence, encode_rows(model, rows, batch_size)
        )
