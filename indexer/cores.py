"""Where the local engine's work runs: the encoder on a core of its own, the reader and the
writer on the others.

Left to the scheduler, the reader process and the writer thread land on the encoder's core
now and then and take slices of its time: on a 2-vCPU Xeon a 1M-record Parquet build's
encoding phase took 9.4-10.7 s, and 7.6-9.2 s with the encoder alone on one core and the
reader and writer sharing the other (alternating runs; lower priority for the reader and
writer instead gave about half that). Only when torch encodes on one thread: pinning a
thread that leads an OpenMP pool would squeeze the pool onto its core. Linux only
(sched_setaffinity); elsewhere, or with a single core allowed, nothing is placed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
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
