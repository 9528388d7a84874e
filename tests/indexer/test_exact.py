"""Exact search (faiss.knn, and for a filter the allowed rows gathered block by block into
faiss.ResultHeap) equals the brute-force reference, on random and on adversarial data, with and
without a filter."""

from __future__ import annotations

import numpy as np
import pytest

from indexer.search import exact

BLOCK_ROWS = 16384  # more rows than FAISS's BLAS path takes in one block
KERNELS = {
    "search": exact.search,
    # every row allowed, gathered in blocks of 1,024 rows (GATHER_BYTES set low below)
    "search_allowed": lambda xq, xb, k: exact.search_allowed(xq, xb, k, np.ones(len(xb), bool)),
}


@pytest.fixture(autouse=True)
def small_gather_blocks(monkeypatch) -> None:
    monkeypatch.setattr(exact, "GATHER_BYTES", 1024)


def reference(xq: np.ndarray, xb: np.ndarray, k: int) -> np.ndarray:
    """The k best scores per query, in float64: what any correct kernel must return."""
    s = xq.astype(np.float64) @ xb.astype(np.float64).T
    return -np.sort(-s, axis=1)[:, : min(k, xb.shape[0])]


def check(kernel: str, xq: np.ndarray, xb: np.ndarray, k: int) -> None:
    scores, pos = KERNELS[kernel](xq, xb, k)
    want = reference(xq, xb, k)
    assert scores.shape == pos.shape == want.shape
    assert np.allclose(scores, want, rtol=1e-5, atol=1e-5), kernel
    for i in range(len(xq)):
        assert len(set(pos[i].tolist())) == pos.shape[1]  # no position twice
        # each returned position really has the returned score (ties may pick either one)
        true = xb[pos[i]].astype(np.float64) @ xq[i].astype(np.float64)
        assert np.allclose(true, scores[i], rtol=1e-5, atol=1e-5), kernel


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "d", "nq", "k"), [(1000, 16, 1, 10), (40_000, 64, 37, 10),
                                                 (20_000, 65, 256, 100), (5, 8, 3, 5),
                                                 (40_000, 64, 5, 10)])  # fmt: skip
def test_random_data(kernel: str, n: int, d: int, nq: int, k: int) -> None:
    rng = np.random.default_rng(n + d)
    xb = rng.standard_normal((n, d)).astype(np.float32)
    xq = rng.standard_normal((nq, d)).astype(np.float32)
    check(kernel, xq, xb, k)


@pytest.mark.parametrize("kernel", KERNELS)
def test_ties_across_blocks(kernel: str) -> None:
    """Many equal scores, spread over several blocks of the blocked kernels."""
    n = 3 * BLOCK_ROWS + 17
    xb = np.zeros((n, 4), np.float32)
    xb[::7, 0] = 1.0  # thousands of rows tie for first place
    xb[1::7, 1] = 2.0
    xq = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]], np.float32)
    check(kernel, xq, xb, 20)


def test_filtered_search_equals_the_reference_on_the_allowed_rows() -> None:
    """Few allowed rows fit one gathered block, many take several: both equal the reference."""
    rng = np.random.default_rng(5)
    xb = rng.standard_normal((3 * BLOCK_ROWS + 5, 8)).astype(np.float32)
    xq = rng.standard_normal((4, 8)).astype(np.float32)
    for share in (0.01, 0.6):
        allowed = rng.random(len(xb)) < share
        for q in (xq[:1], xq):
            scores, pos = exact.search_allowed(q, xb, 10, allowed)
            assert allowed[pos].all()
            want = reference(q, xb[allowed], 10)
            assert np.allclose(scores, want, rtol=1e-5, atol=1e-5)
    none = np.zeros(len(xb), dtype=bool)
    assert exact.search_allowed(xq, xb, 10, none)[0].shape == (4, 0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_k_larger_than_the_view_and_empty_views(kernel: str) -> None:
    rng = np.random.default_rng(1)
    xb = rng.standard_normal((7, 5)).astype(np.float32)
    xq = rng.standard_normal((4, 5)).astype(np.float32)
    check(kernel, xq, xb, 50)
    scores, pos = exact.search(xq, np.zeros((0, 5), np.float32), 10)
    assert scores.shape == pos.shape == (4, 0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_on_a_memory_map(tmp_path, kernel: str) -> None:
    rng = np.random.default_rng(2)
    np.save(tmp_path / "v.npy", rng.standard_normal((30_000, 32)).astype(np.float32))
    xb = np.load(tmp_path / "v.npy", mmap_mode="c")
    check(kernel, rng.standard_normal((9, 32)).astype(np.float32), xb, 10)


def test_a_lone_query_split_over_threads_equals_the_reference(monkeypatch) -> None:
    from indexer.search import lone_query

    monkeypatch.setattr(lone_query, "MIN_PART_ROWS", 1000)
    lone_query.use_threads(3)
    try:
        rng = np.random.default_rng(7)
        xb = rng.standard_normal((10_007, 16)).astype(np.float32)
        for q in rng.standard_normal((5, 16)).astype(np.float32):
            scores, pos = lone_query.search(q[None], xb, 10)
            assert np.allclose(scores, reference(q[None], xb, 10), rtol=1e-5, atol=1e-5)
            assert np.allclose(xb[pos[0]] @ q, scores[0], rtol=1e-5, atol=1e-5)
        tiny = xb[:7]  # fewer rows than k and than a slice: one scan, k cut to the rows
        assert lone_query.search(xb[:1], tiny, 10)[0].shape == (1, 7)
    finally:
        lone_query.use_threads(1)
