from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from indexer.arrays import FlatIPAppender, NpyAppender


def test_streamed_npy_is_memory_mappable(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((1001, 7), dtype=np.float32)
    with NpyAppender(tmp_path / "x.npy", 7) as w:
        for start in range(0, 1001, 300):
            w.append(x[start : start + 300])
    y = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert y.shape == (1001, 7) and np.array_equal(x, y)


def test_streamed_flat_index_is_byte_identical_to_faiss(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((500, 9)).astype(np.float32)
    with FlatIPAppender(tmp_path / "f.faiss", 9) as w:
        w.append(x[:123])
        w.append(x[123:])
    reference = faiss.IndexFlatIP(9)
    reference.add(x)
    assert (tmp_path / "f.faiss").read_bytes() == faiss.serialize_index(reference).tobytes()
    mapped = faiss.read_index(
        str(tmp_path / "f.faiss"), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
    )
    d1, i1 = mapped.search(x[:5], 4)
    d2, i2 = reference.search(x[:5], 4)
    assert np.array_equal(i1, i2) and np.allclose(d1, d2)


def test_empty_and_wrong_width(tmp_path: Path) -> None:
    with FlatIPAppender(tmp_path / "e.faiss", 3) as w, pytest.raises(ValueError, match="width 3"):
        w.append(np.zeros((2, 4), np.float32))
    assert faiss.read_index(str(tmp_path / "e.faiss")).ntotal == 0
