"""Writing a version's rows: the record store, one (rows, d) float32 .npy per modality and the
exact views, on a thread of its own a few batches behind the encoder."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from indexer.build.views import FlatViewsWriter
from indexer.store.arrays import NpyAppender
from indexer.store.artifact import EMBEDDINGS
from indexer.store.recordstore import RecordStoreWriter

log = logging.getLogger(__name__)


class RowWriter:
    """Appends rows to the record store, one (rows, d) float32 .npy per modality and, when
    given, the exact views (indexer.build.views.FlatViewsWriter).

    A record lacking a modality gets a zero row there; the store's presence flags say which
    rows are real. Writing runs on a thread of its own, a few batches behind the caller, so
    that encoding never waits for it: copies into the page cache, the views' products and the
    id hashes take a second core, not the encoder's time. The thread starts at the first
    write (a reader process forked before it copies no running thread); its error, if any, is
    raised by the next write_rows or by close().
    """

    def __init__(
        self,
        vdir: Path,
        names: list[str],
        dim: int,
        filter_fields: tuple[str, ...] = (),
        views: FlatViewsWriter | None = None,
        field_types: dict[str, str] | None = None,
    ):
        self.vdir = vdir
        self.names = names
        self.dim = dim
        self.store = RecordStoreWriter(vdir, names, filter_fields, field_types)
        (vdir / EMBEDDINGS).mkdir(exist_ok=True)
        self.arrays = {n: NpyAppender(vdir / EMBEDDINGS / f"{n}.npy", dim) for n in names}
        self.views = views
        if views is not None:
            views.embedding_files = self.arrays  # a view that is stored embeddings links them
        self._queue: queue.Queue[Callable[[], Batch | None] | None]
        self._queue = queue.Queue(maxsize=WRITE_BEHIND)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def rows(self) -> int:
        return self.store.rows

    def write_rows(
        self,
        ids: list[str],
        payloads: list[bytes],
        presence: np.ndarray,
        embs: dict[str, np.ndarray],
    ) -> None:
        batch = Batch(ids, payloads, presence.reshape(len(ids), len(self.names)), embs)
        self.write_later(lambda: batch)

    def write_later(self, make: Callable[[], Batch | None]) -> None:
        """`make()` runs on the writer thread, in turn: the batch it returns is written (None:
        nothing to write). For work that must happen in row order but need not hold up the
        caller, such as admitting a chunk's ids (indexer.build.local)."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hclip-writer", daemon=True)
            self._thread.start()
        self._queue.put(make)

    def drain(self) -> None:
        """Wait until everything handed over is written; raise the writer's error if any."""
        self._queue.join()
        self._raise_error()

    def _run(self) -> None:
        while True:
            make = self._queue.get()
            try:
                if make is None:
                    return
                if self._error is not None:
                    continue  # keep taking work, so that the caller never blocks on a full queue
                batch = make()
                if batch is not None:
                    self._write(batch)
            except BaseException as exc:  # raised in the caller's thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _write(self, b: Batch) -> None:
        self.store.append(b.ids, b.payloads, b.presence)
        for n in self.names:
            self.arrays[n].append(b.embs[n])
        if self.views is not None:
            self.views.append(b.embs, b.presence)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self.store.close()
        for arr in self.arrays.values():
            arr.close()
        if self.views is not None:
            self.views.close()
        self._raise_error()


WRITE_BEHIND = 2  # batches queued for the writer thread


@dataclass
class Batch:
    """Rows for RowWriter: ids, payloads (JSON bytes), (n, m) presence, (n, d) embeddings."""

    ids: list[str]
    payloads: list[bytes]
    presence: np.ndarray
    embs: dict[str, np.ndarray]
