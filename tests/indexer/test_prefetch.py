"""The local engine's reader, in a thread or a forked child: items in order, errors raised at
the item where they happened, and a consumer that stops early stops the producer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from indexer import prefetch
from models.records import RecordError

MODES = {"thread": prefetch.in_thread, "child": prefetch.in_child}
REPO = Path(__file__).resolve().parents[2]


def numbers(n: int, fail_at: int | None = None) -> Iterator[int]:
    for i in range(n):
        if i == fail_at:
            raise RecordError("bad record", 7, "r-7")
        yield i


@pytest.mark.parametrize("mode", MODES)
def test_tensors_outlive_the_child(mode: str) -> None:
    """Decoded images and audio are tensors; the child exits before they are read."""
    items = list(MODES[mode](lambda: iter([[torch.arange(6.0).reshape(2, 3)]] * 3), 2))
    assert all(torch.equal(x[0], torch.arange(6.0).reshape(2, 3)) for x in items)


@pytest.mark.parametrize("mode", MODES)
def test_items_in_order_and_the_error_where_it_happened(mode: str) -> None:
    run = MODES[mode]
    assert list(run(lambda: numbers(50), 3)) == list(range(50))
    got = []
    with pytest.raises(RecordError, match="line 7, id 'r-7': bad record"):
        for item in run(lambda: numbers(50, fail_at=20), 3):
            got.append(item)
    assert got == list(range(20))


def endless(marks: Path) -> Iterator[int]:
    """0, 1, 2... with a line in `marks` (the producer's pid) as each is produced."""
    i = 0
    while True:
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        yield i
        i += 1


@pytest.mark.parametrize("mode", MODES)
def test_a_consumer_that_stops_stops_the_producer(mode: str, tmp_path) -> None:
    marks = tmp_path / "produced"
    items = MODES[mode](lambda: endless(marks), 2)
    assert [next(items) for _ in range(5)] == list(range(5))
    items.close()
    time.sleep(1)
    before = marks.read_text().count("\n")
    time.sleep(1)
    assert marks.read_text().count("\n") == before  # nothing produced after close
    pids = set(marks.read_text().split())
    assert (pids == {str(os.getpid())}) == (mode == "thread")


@pytest.mark.parametrize("mode", MODES)
def test_the_producer_works_depth_items_ahead(mode: str, tmp_path) -> None:
    """Up to `depth` items wait for the consumer (the child's in shared-memory slots), and
    one more is produced and waits for room: so a slow consumer never waits on the reader."""
    marks = tmp_path / "produced"
    for depth in (1, 3):
        marks.write_text("")
        items = MODES[mode](lambda: endless(marks), depth)
        assert next(items) == 0
        expected = 1 + depth + 1
        deadline = time.monotonic() + 30  # a loaded machine may take a while to get there
        while marks.read_text().count("\n") < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # and it stops there: no more than that is produced ahead
        assert marks.read_text().count("\n") == expected
        assert [next(items) for _ in range(10)] == list(range(1, 11))
        items.close()


def test_an_item_bigger_than_a_slot_crosses_the_pipe(monkeypatch) -> None:
    """The child's slots have a fixed size; a bigger item takes the pipe, in its place."""
    monkeypatch.setattr(prefetch, "SLOT_BYTES", 4096)  # the forked child inherits it
    sizes = [10, 100_000, 20, 5000, 30, 300_000, 40]
    items = list(prefetch.in_child(lambda: (np.full(n, n % 256, dtype=np.uint8) for n in sizes), 2))
    assert [len(x) for x in items] == sizes
    assert all((x == n % 256).all() for x, n in zip(items, sizes, strict=True))


CHOICE = """
import os, threading
from indexer import prefetch

def pids():
    yield os.getpid()

alone = list(prefetch.ahead(pids, 2)) != [os.getpid()]  # produced by a child
stop = threading.Event()
other = threading.Thread(target=stop.wait)
other.start()
with_thread = list(prefetch.ahead(pids, 2)) != [os.getpid()]
stop.set()
other.join()
print(alone, with_thread)
"""


def test_the_child_is_chosen_only_without_other_python_threads() -> None:
    """A fork copies one thread; a lock that another thread held would stay locked in the
    child. So with a second Python thread running, the reader is a thread. (In a fresh
    process: a test run may have left threads of its own, tqdm's monitor for one.)"""
    done = subprocess.run(
        [sys.executable, "-c", CHOICE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
