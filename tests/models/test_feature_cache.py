"""The feature cache: a batch's features read, computed once and stored, and the SQLite file
opened by several DataLoader workers at once."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.config import ConfigError
from models.train.feature_cache import FeatureStore, complete, gather


def _tower(items: list[int]) -> torch.Tensor:
    return torch.tensor([[float(x), -float(x)] for x in items])


def _fill(store: FeatureStore, worker: int, start: Any) -> None:
    start.wait()  # the workers' first batches: every one opens the file at once
    for i in range(3):
        key = worker * 1000 + i
        complete(gather([key], torch.tensor([key]), store), _tower, store)


def test_workers_opening_a_new_store_at_once_lose_nothing(tmp_path: Path) -> None:
    """Processes that set up a new SQLite file at the same moment fail now and then with
    "database is locked" (about one start in six here): the store is set up where it is
    made, before the workers start, so twenty starts of three workers all succeed."""
    ctx = mp.get_context("fork")  # as DataLoader workers start on Linux
    for trial in range(20):
        store = FeatureStore(tmp_path / f"tower-{trial}")  # where the loader is built
        start = ctx.Barrier(3)
        procs = [ctx.Process(target=_fill, args=(store, w, start)) for w in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 3, f"start {trial}"
        wanted = [w * 1000 + i for w in range(3) for i in range(3)]
        found = store.read(wanted)
        assert sorted(found) == wanted
        assert all(np.frombuffer(found[k], np.float32).tolist() == [k, -k] for k in wanted)
        store.close()


def test_a_batch_reads_what_is_stored_and_computes_each_missing_input_once(
    tmp_path: Path,
) -> None:
    store = FeatureStore(tmp_path / "tower")
    calls: list[list[int]] = []

    def tower(items: list[int]) -> torch.Tensor:
        calls.append(list(items))
        return _tower(items)

    first = complete(gather([1, 2, 1], torch.tensor([1, 2, 1]), store), tower, store)
    assert calls == [[1, 2]] and first.tolist() == [[1, -1], [2, -2], [1, -1]]
    again = complete(gather([2, 3], torch.tensor([2, 3]), store), tower, store)
    assert calls[-1] == [3] and again.tolist() == [[2, -2], [3, -3]]
    nothing = complete(gather([7], torch.tensor([7]), None), tower, None)  # no cache
    assert calls[-1] == [7] and nothing.tolist() == [[7, -7]]


def test_a_cache_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    expected = r"feature cache .*a-file/tower/features.sqlite: .*HCLIP_FEATURE_CACHE=off trains"
    with pytest.raises(ConfigError, match=expected):
        FeatureStore(tmp_path / "a-file" / "tower")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "features.sqlite").write_bytes(b"not a database, " * 100)
    with pytest.raises(ConfigError, match=r"garbage/features.sqlite: file is not a database"):
        FeatureStore(tmp_path / "garbage")
