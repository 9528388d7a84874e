"""What a loaded version holds, kept out of the cyclic garbage collector's scans.

A worker's heap once a version is loaded holds hundreds of thousands of objects that live as
long as the version serves: torch, transformers, the towers' modules, the records' store.
Python's full collection walks all of them while it holds the GIL, so every few seconds under
load no request moves for as long as that walk takes, a fifth of a second with real-size towers
(docs/benchmarks/tower_serving.md).
`gc.freeze()` moves them to a generation that collections skip.

A swap thaws the heap, so that the version it retires can be collected once the requests that
hold it are done; the heap is settled again (collected, then frozen) when the request deadline
has passed since the swap. A worker's shutdown thaws it, so a process that made the app (a test,
an embedding program) keeps no frozen garbage.
"""

from __future__ import annotations

import gc
import time


class HeapSettler:
    """When the heap is next to be collected and frozen: `settle_in(s)` after a load,
    `settle_if_due()` from the version poller (and after the first load)."""

    def __init__(self) -> None:
        self._due: float | None = None

    def settle_in(self, seconds: float) -> None:
        """A version was swapped in: the heap thaws now, and settles in `seconds` (the requests
        that hold the version it replaced are over by then)."""
        gc.unfreeze()
        self._due = time.monotonic() + max(0.0, seconds)

    def settle_if_due(self) -> bool:
        """Collect and freeze the heap if a swap's wait is over; True when it did."""
        if self._due is None or time.monotonic() < self._due:
            return False
        self._due = None
        gc.collect()
        gc.freeze()
        return True

    def thaw(self) -> None:
        """The worker stops: what was frozen can be collected again."""
        self._due = None
        gc.unfreeze()
