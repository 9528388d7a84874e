"""The local engine's placement (indexer.cores): the encoder alone on one core, the reader and
the writer on the others, only when torch encodes on one thread, and every thread put back."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from indexer import cores
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
