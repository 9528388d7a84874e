from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from indexer.store.arrays import NpyAppender, NpyRows


def test_streamed_npy_is_memory_mappable(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((1001, 7), dtype=np.float32)
    with NpyAppender(tmp_path / "x.npy", 7) as w:
        for start in range(0, 1001, 300):
            w.append(x[start : start + 300])
    y = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert y.shape == (1001, 7) and np.array_equal(x, y) and y.flags.aligned
    rows = NpyRows(tmp_path / "x.npy")
    idx = np.array([0, 5, 6, 1000])
    assert np.array_equal(rows[idx], x[idx])


@pytest.mark.parametrize(("dtype", "dim"), [("<i8", None), ("|b1", 3), ("<u8", None)])
def test_other_dtypes_and_vectors(tmp_path: Path, dtype: str, dim: int | None) -> None:
    shape = (50,) if dim is None else (50, dim)
    x = (np.arange(np.prod(shape)) % 3).reshape(shape).astype(dtype)
    with NpyAppender(tmp_path / "x.npy", dim, dtype) as w:
        w.append(x[:20])
        w.append(x[20:])
    y = np.load(tmp_path / "x.npy")
    assert y.dtype == np.dtype(dtype) and np.array_equal(x, y)


def test_empty_and_wrong_width(tmp_path: Path) -> None:
    with NpyAppender(tmp_path / "e.npy", 3) as w, pytest.raises(ValueError, match="width 3"):
        w.append(np.zeros((2, 4), np.float32))
    assert np.load(tmp_path / "e.npy").shape == (0, 3)
