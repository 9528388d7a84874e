"""The local engine's placement (indexer.cores): the encoder alone on one core, the reader on
the others, the writer beside whichever has time to spare, only when torch encodes on one
thread, and every thread put back."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from indexer import cores
from indexer.build import JobOptions, build
from indexer.columnar import Checked, ChunkChecker
from indexer.encode import RowWriter
from indexer.sources import Chunk
from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="placement needs Linux and two cores",
)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_plan_only_when_torch_encodes_on_one_thread(one_torch_thread: None) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    plan = cores.plan()
    assert plan is not None
    assert len(plan.encoder) == 1 and not plan.encoder & plan.others
    assert plan.encoder | plan.others == allowed
    torch.set_num_threads(2)  # the encoder leads an OpenMP pool: leave it free
    assert cores.plan() is None


def test_a_build_places_each_thread_and_puts_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    plan = cores.plan()
    assert plan is not None
    log = tmp_path / "placed"
    real = cores.place_thread

    def recording(cpus: frozenset[int], thread_id: int = 0) -> None:
        real(cpus, thread_id)  # then what the thread got, as the kernel says (a forked reader too)
        with open(log, "a") as f:
            got = ",".join(map(str, sorted(os.sched_getaffinity(0))))
            f.write(f"{os.getpid()} {threading.current_thread().name} {got}\n")

    monkeypatch.setattr(cores, "place_thread", recording)
    model = make_model_dir(tmp_path / "model")
    records = write_jsonl(tmp_path / "r.jsonl", vector_records(300, DIMS))
    assert index_build(model, records, tmp_path / "root", "--batch-size", "64") == 0

    def cpus(text: str) -> frozenset[int]:
        return frozenset(int(c) for c in text.split(","))

    placed = [line.split() for line in log.read_text().splitlines()]
    main = [cpus(c) for pid, name, c in placed if int(pid) == os.getpid() and name == "MainThread"]
    assert main == [plan.encoder, allowed]  # the encoder's core for the encoding, then all again
    reader = [
        cpus(c) for pid, name, c in placed if int(pid) != os.getpid() or name == "hclip-reader"
    ]
    assert reader[0] == plan.others
    assert [cpus(c) for _, name, c in placed if name == "hclip-writer"] == [plan.others]
    assert frozenset(os.sched_getaffinity(0)) == allowed


def test_the_writer_moves_to_the_core_that_has_time_to_spare() -> None:
    plan = cores.Placement(frozenset({0}), frozenset({1}))
    moved: list[frozenset[int]] = []
    side = cores.WriterSide(plan, moved.append)
    window = cores.WriterSide.WINDOW

    def chunks(waited: float, worked: float, late: int = window) -> None:
        """A window whose first `late` chunks waited `waited` s, the others none."""
        for i in range(window):
            side.report(waited if i < late else 0.0, worked)

    side.report(5.0, 1.0)  # the first chunk waits for start-up: no verdict
    chunks(0.0, 1.0)
    assert moved == [] and side.cpus == plan.others
    chunks(5.0, 1.0, late=1)  # one stall of the reader: not a bottleneck
    assert moved == []
    chunks(0.3, 1.0)  # the encoder waits for every chunk: its core has time to spare
    assert moved == [plan.encoder]
    chunks(0.3, 1.0, late=3)  # between the two counts: where it is
    chunks(0.05, 1.0)  # waits under a tenth of a chunk's time do not count
    assert moved == [plan.encoder, plan.others]
    chunks(0.3, 1.0, late=5)
    assert len(moved) == 2
    for _ in range(window - 1):
        side.report(1.0, 1.0)
    assert len(moved) == 2  # one decision per window, not per chunk
    side.report(1.0, 1.0)
    assert moved[-1] == plan.encoder and len(moved) == 3


def test_a_writer_thread_is_moved_while_it_runs(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    writer = RowWriter(tmp_path, ["a"], 4)
    writer.cpus = frozenset(allowed[1:])
    try:
        writer.write_rows(["x"], [b"{}"], np.ones((1, 1), bool), {"a": np.ones((1, 4), "f4")})
        writer.drain()
        thread = writer._thread
        assert thread is not None and thread.native_id is not None
        assert os.sched_getaffinity(thread.native_id) == set(allowed[1:])
        writer.place(frozenset(allowed[:1]))
        assert os.sched_getaffinity(thread.native_id) == set(allowed[:1])
    finally:
        writer.close()
    assert writer.rows == 1


def test_a_build_that_waits_on_its_reader_moves_the_writer_beside_the_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    plan = cores.plan()
    assert plan is not None
    real_check = ChunkChecker.check

    def slow_check(self: ChunkChecker, chunk: Chunk) -> Checked:
        time.sleep(0.02)  # a reader slower than the encoder (the forked reader inherits it)
        return real_check(self, chunk)

    monkeypatch.setattr(ChunkChecker, "check", slow_check)
    moves: list[frozenset[int]] = []
    real_place = RowWriter.place

    def recording(self: RowWriter, cpus: frozenset[int]) -> None:
        real_place(self, cpus)
        moves.append(frozenset(os.sched_getaffinity(self._thread.native_id)))  # type: ignore[union-attr]

    monkeypatch.setattr(RowWriter, "place", recording)
    model = make_model_dir(tmp_path / "model")
    records = write_jsonl(tmp_path / "r.jsonl", vector_records(400, DIMS))
    opts = JobOptions(progress=False, chunk_rows=16, batch_size=16)
    result = build(model, records, tmp_path / "root", opts)
    assert result.manifest["counts"]["records"] == 400
    assert moves[:1] == [plan.encoder]  # the kernel's word for where the writer runs now
