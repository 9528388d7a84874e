"""The local engine's read-ahead: items in order from a pool of forked readers (or here), the
error raised at the item where it happened, at most `depth` items in flight, and a consumer
that stops early stops the readers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from indexer.build import readahead
from models.records import RecordError

REPO = Path(__file__).resolve().parents[2]
WORKERS = {"here": 0, "one reader": 1, "two readers": 2}


def square(i: int) -> int:
    if i == 20:
        raise RecordError("bad record", 7, "r-7")
    return i * i


@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS)
def test_items_in_order_and_the_error_where_it_happened(workers: int) -> None:
    assert list(readahead.ahead(lambda i: i + 1, range(50), workers, 3)) == list(range(1, 51))
    got = []
    with pytest.raises(RecordError, match="line 7, id 'r-7': bad record"):
        for item in readahead.ahead(square, range(50), workers, 3):
            got.append(item)
    assert got == [i * i for i in range(20)]


def tensors(i: int) -> list[torch.Tensor]:
    return [torch.arange(6.0).reshape(2, 3) + i]


@pytest.mark.parametrize("workers", [1, 2])
def test_tensors_outlive_the_readers(workers: int) -> None:
    """Decoded images and audio are tensors; the readers are gone before they are read."""
    items = list(readahead.ahead(tensors, range(3), workers, 2))
    assert all(torch.equal(x[0], torch.arange(6.0).reshape(2, 3) + i) for i, x in enumerate(items))


IN_FLIGHT = """
import os, sys, time
from pathlib import Path
from indexer.build import readahead

class Marked:
    # i -> i, with a line in `marks` (the worker's pid) as each is produced
    def __init__(self, marks):
        self.marks = marks

    def __call__(self, i):
        with open(self.marks, "a") as f:
            f.write(f"{os.getpid()}\\n")
        return i

def counted(marks):
    return marks.read_text().count("\\n") if marks.exists() else 0

marks, workers = Path(sys.argv[1]), int(sys.argv[2])
for depth in (1, 3):
    marks.write_text("")
    items = readahead.ahead(Marked(marks), iter(range(10**6)), workers, depth)
    assert next(items) == 0
    deadline = time.monotonic() + 30  # a loaded machine may take a while to get there
    while counted(marks) < 1 + depth and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # and it stops there: no more than depth beyond the one taken
    assert counted(marks) == 1 + depth, (depth, counted(marks))
    assert [next(items) for _ in range(10)] == list(range(1, 11))
    items.close()
    before = counted(marks)
    time.sleep(0.5)
    assert counted(marks) == before, "produced after close"
    assert str(os.getpid()) not in set(marks.read_text().split()), "not made by the readers"
print("ok")
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_at_most_depth_items_in_flight_and_closing_stops_them(workers: int, tmp_path) -> None:
    """In a fresh process, where no other Python thread forbids the fork."""
    done = subprocess.run(
        [sys.executable, "-c", IN_FLIGHT, str(tmp_path / "produced"), str(workers)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


CHOICE = """
import os, threading
from indexer.build import readahead

def pid(_):
    return os.getpid()

alone = list(readahead.ahead(pid, [0], 1, 2)) != [os.getpid()]  # produced by a reader
stop = threading.Event()
other = threading.Thread(target=stop.wait)
other.start()
with_thread = list(readahead.ahead(pid, [0], 1, 2)) != [os.getpid()]
stop.set()
other.join()
print(alone, with_thread)
"""


def test_readers_are_forked_only_without_other_python_threads() -> None:
    """A fork copies one thread; a lock that another thread held would stay locked in the
    child. So with a second Python thread running, the chunks are checked here. (In a fresh
    process: a test run may have left threads of its own, tqdm's monitor for one.)"""
    done = subprocess.run(
        [sys.executable, "-c", CHOICE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
