"""The workers of one server share the cores for tower encodes (app.services.core_share): a
worker encoding alone takes every core, workers encoding at once split them."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from app.services.core_share import CoreShare

# Another worker: claims a slot, starts an encode, says how many threads it got, holds it.
WORKER = """
import sys, time
from pathlib import Path
from app.services.core_share import CoreShare
share = CoreShare(4, 1, Path(sys.argv[1]))
with share.threads() as n:
    print(n, flush=True)
    time.sleep(120)
"""


def other_worker(directory: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_lone_encode_takes_every_core_and_workers_encoding_together_split_them(
    tmp_path: Path,
) -> None:
    here = CoreShare(4, 1, tmp_path)
    with here.threads() as n:
        assert n == 4  # alone
    with here.threads(batch=8) as n:
        assert n == 1  # a batch: the server is busy, the worker keeps its share
    first, got = other_worker(tmp_path)
    try:
        assert got == 4  # it encodes alone: this worker is idle
        with here.threads() as n:
            assert n == 2  # two workers encoding
        first.kill()  # dies in the middle of its encode: its count stays behind ...
        first.wait()
        with here.threads() as n:
            assert n == 2
        second, got = other_worker(tmp_path)  # ... until its replacement takes the slot
        try:
            assert got == 4
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()
    here.close()


def test_two_encodes_in_one_worker_split_its_cores() -> None:
    share = CoreShare(4, 2)  # serving alone: only this process's encodes count
    inside, release = threading.Event(), threading.Event()

    def encode() -> None:
        with share.threads():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=encode)
    t.start()
    inside.wait(10)
    with share.threads() as n:
        assert n == 2
    share.floor = 3
    with share.threads() as n:
        assert n == 3  # never below the worker's fixed share
    share.floor = 2
    release.set()
    t.join()
    with share.threads() as n:
        assert n == 4
