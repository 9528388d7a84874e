"""How many cores a lone search may spread its scan over: the machine's cores that no other
search is using, counted across every worker process (docs/benchmarks/serving.md: a lone
query's latency on an idle machine, against one thread per query).

Each worker counts its searches in flight in a slot of its own of an array in shared memory
(made by `hclip serve` before it starts the workers; a lone process has a local one), and
reads the others' slots, so that two lone queries in two workers never split over the same
cores. The counts are read without a lock: a stale one costs one search a thread too many or
too few, never a wrong answer.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
from typing import Any

_shared: Any = None  # the workers' array, set in each worker before the app is built
_slot = 0


def make_shared(workers: int) -> Any:
    """The array `hclip serve` passes to its workers (one int per worker)."""
    return multiprocessing.sharedctypes.RawArray("i", workers)


def attach(shared: Any, slot: int) -> None:
    """In a worker process: count this worker's searches in `shared[slot]`."""
    global _shared, _slot
    _shared, _slot = shared, slot
    shared[slot] = 0  # a restarted worker: its predecessor's searches died with it


class SearchLoad:
    def __init__(self, cores: int):
        self.cores = cores
        self.counts: Any = _shared if _shared is not None else [0]  # a list or a RawArray
        self.slot = _slot if _shared is not None else 0

    def begin(self) -> None:
        self.counts[self.slot] += 1

    def end(self) -> None:
        self.counts[self.slot] -= 1

    def alone(self) -> bool:
        """No other search is in flight in this process."""
        return bool(self.counts[self.slot] <= 1)

    def lone_parts(self) -> int:
        """The threads a search may scan on now: itself and the cores left idle by the
        others in flight (at least one)."""
        busy = sum(self.counts)
        return max(1, self.cores - max(busy - 1, 0))
