"""How the workers of one `hclip serve` share the cores for tower encodes: a lone query takes
the cores no other encode is using; a batch (the server is under load) keeps its worker's share.

A tower's forward takes all the threads it is given: a raw image query through ViT-B/16 is a
third faster on two cores than on one. But N workers each holding every core oversubscribe
them under load (MiniLM lost a fifth of its served throughput at 2 workers x 2 threads on 2
cores, and a tenth when batches also took the free cores). So an encode of one input counts
the encodes running in every worker of the server and takes the cores they leave, and larger
batches keep the fixed share (docs/benchmarks/tower_serving.md has the figures).

The count lives in a file of one byte per worker slot (HCLIP_WORKERS_DIR/encoding) that every
worker maps; a worker claims its slot with a lock on that byte, held for its life, so a dead
worker's slot is free again and whoever claims it next resets its count. A process serving
alone (no workers directory) counts only its own encodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SLOTS = 256  # workers one server can have; past it a worker counts only its own encodes
FILE = "encoding"


class CoreShare:
    """`cores` of the machine; `floor`: each worker's fixed share (the cores over the workers)."""

    def __init__(self, cores: int, floor: int = 1, directory: Path | None = None):
        self.cores = max(1, cores)
        self.floor = max(1, min(floor, self.cores))
        self._lock = threading.Lock()
        self._mine = 0  # this worker's encodes running now
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._slot = 0
        if directory is not None:
            self._claim(directory / FILE)

    def _claim(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < SLOTS:
            os.ftruncate(fd, SLOTS)  # workers starting together all truncate to one size
        for slot in range(SLOTS):
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot, os.SEEK_SET)
            except OSError:
                continue
            self._fd, self._slot = fd, slot
            self._map = mmap.mmap(fd, SLOTS)
            self._map[slot] = 0  # a dead worker's count, if it held this slot
            return
        os.close(fd)
        log.warning("%s: every slot is taken; this worker counts only its own encodes", path)

    @property
    def slot(self) -> int:
        """This worker's place among the server's (0 serving alone)."""
        return self._slot

    def _running(self) -> int:
        """Encodes running now in every worker (this one's included)."""
        if self._map is None:
            return self._mine
        return int(np.frombuffer(self._map, dtype=np.uint8).sum(dtype=np.int64))

    def _add(self, n: int) -> int:
        with self._lock:
            self._mine += n
            if self._map is not None:
                self._map[self._slot] = min(255, self._mine)
            return self._running()

    @contextlib.contextmanager
    def threads(self, batch: int = 1) -> Iterator[int]:
        """For one encode call of `batch` inputs: the threads it may use while it runs."""
        running = self._add(1)
        try:
            yield max(self.floor, self.cores // max(1, running)) if batch == 1 else self.floor
        finally:
            self._add(-1)

    def close(self) -> None:
        if self._map is not None:
            self._map[self._slot] = 0
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)  # releases the slot's lock
            self._fd = None
