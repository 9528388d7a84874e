"""Where the local engine's work runs: the encoder on a core of its own, the reader on the
others, and the writer beside whichever of the two has time to spare.

Left to the scheduler, the reader process and the writer thread land on the encoder's core
now and then and take slices of its time: on a 2-vCPU Xeon a 1M-record Parquet build's
encoding phase took 9.4-10.7 s, and 7.6-9.2 s with the encoder alone on one core and the
reader and writer sharing the other (alternating runs; lower priority for the reader and
writer instead gave about half that). Only when torch encodes on one thread: pinning a
thread that leads an OpenMP pool would squeeze the pool onto its core. Linux only
(sched_setaffinity); elsewhere, or with a single core allowed, nothing is placed.

The writer starts on the reader's side, right while the encoder is the bottleneck (Parquet,
whose reader idles half the time). Where the reader is the bottleneck (JSON Lines, whose
parsing takes longer than the encoding on a fast core), the encoder waits for chunks with its
core idle, and the writer moves there (WriterSide): on a 2-vCPU Xeon with AMX (KVM, model
167) a 1M-record JSON Lines build's encoding phase took 8.1-9.0 s with the writer beside the
reader and 7.1-7.4 s beside the encoder, while Parquet's took 5.4-6.0 s beside the reader and
6.2-6.5 s with the writer left to the scheduler (alternating runs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    encoder: frozenset[int]  # the one core the encoding thread keeps to itself
    others: frozenset[int]  # every other core this process may use: the reader and the writer


def plan() -> Placement | None:
    """The placement for this process, or None where nothing should be placed."""
    if not hasattr(os, "sched_setaffinity") or torch.get_num_threads() != 1:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return Placement(frozenset(allowed[:1]), frozenset(allowed[1:]))


def place_thread(cpus: frozenset[int], thread_id: int = 0) -> None:
    """Keep a thread (by its native id; 0: the calling one) to `cpus`. A failure (a core
    taken away meanwhile, a container that forbids it) leaves it where it was: placement is
    an optimisation, never a reason to fail a build."""
    try:
        os.sched_setaffinity(thread_id, cpus)
    except OSError as exc:
        log.debug("could not place thread %d on cores %s: %s", thread_id, sorted(cpus), exc)


@contextlib.contextmanager
def placed(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread kept to `cpus` (None: left alone) for the block, then put back."""
    if cpus is None:
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    place_thread(cpus)
    try:
        yield
    finally:
        place_thread(before)


class WriterSide:
    """Moves the writer's thread to the side of the engine that has time to spare, judged
    from what the encoding thread reports: after each chunk, how long it waited for the chunk
    and how long it then worked. A chunk waited for (more than WAITED of its time) says the
    reader was behind. Every WINDOW chunks it decides: when at least TO_ENCODER of them were
    waited for, the reader is the bottleneck and the encoder's core idles, so the writer goes
    there; when at most TO_READER were, it goes back beside the reader (the gap between the
    two keeps it from moving to and fro).

    Chunks are counted, not seconds summed, so that one stall of the reader does not move
    the writer: in a 3M-record Parquet build, encoder-bound throughout, a stall of the reader
    took 52% of one window's time, and a rule on the window's time share moved the writer
    onto the encoder's core for the rest of the build (seen with `hclip -v`). The first
    chunk's wait is start-up, not a verdict."""

    WINDOW = 8  # chunks per decision: at most one move per 64k records at the default chunk
    WAITED = 0.10  # of a chunk's time, waiting for it
    TO_ENCODER = 6  # chunks of a window waited for
    TO_READER = 1

    def __init__(self, placement: Placement, move: Callable[[frozenset[int]], None]):
        self.placement = placement
        self.move = move  # places the writer's thread on these cores
        self.cpus = placement.others
        self.late = 0  # chunks of this window waited for
        self.chunks = -1  # the first report is skipped

    def report(self, waited: float, worked: float) -> None:
        self.chunks += 1
        if self.chunks == 0:
            return
        if waited > self.WAITED * (waited + worked):
            self.late += 1
        if self.chunks % self.WINDOW:
            return
        late, self.late = self.late, 0
        if late >= self.TO_ENCODER and self.cpus != self.placement.encoder:
            self._go(self.placement.encoder, late)
        elif late <= self.TO_READER and self.cpus != self.placement.others:
            self._go(self.placement.others, late)

    def _go(self, cpus: frozenset[int], late: int) -> None:
        log.debug(
            "writer moves to cores %s (%d of %d chunks waited for)", sorted(cpus), late, self.WINDOW
        )
        self.cpus = cpus
        self.move(cpus)
