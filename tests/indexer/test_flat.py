"""Every exact kernel equals the brute-force reference, on random and on adversarial data."""

from __future__ import annotations

import numpy as np
import pytest

from indexer import flat

KERNELS = list(flat.KERNELS)


def reference(xq: np.ndarray, xb: np.ndarray, k: int) -> np.ndarray:
    """The k best scores per query, in float64: what any correct kernel must return."""
    s = xq.astype(np.float64) @ xb.astype(np.float64).T
    return -np.sort(-s, axis=1)[:, : min(k, xb.shape[0])]


def check(kernel: str, xq: np.ndarray, xb: np.ndarray, k: int) -> None:
    scores, pos = flat.search(kernel, xq, xb, k)
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
                                                 (20_000, 65, 256, 100), (5, 8, 3, 5)])  # fmt: skip
def test_random_data(kernel: str, n: int, d: int, nq: int, k: int) -> None:
    rng = np.random.default_rng(n + d)
    xb = rng.standard_normal((n, d)).astype(np.float32)
    xq = rng.standard_normal((nq, d)).astype(np.float32)
    check(kernel, xq, xb, k)


@pytest.mark.parametrize("kernel", KERNELS)
def test_ties_across_blocks(kernel: str) -> None:
    """Many equal scores, spread over several blocks of the blocked kernels."""
    n = 3 * flat.BLOCK_ROWS + 17
    xb = np.zeros((n, 4), np.float32)
    xb[::7, 0] = 1.0  # thousands of rows tie for first place
    xb[1::7, 1] = 2.0
    xq = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]], np.float32)
    check(kernel, xq, xb, 20)


def test_blocked_scan_across_many_small_blocks(monkeypatch) -> None:
    """FAISS's blocked scan with blocks of 256 rows: ties spread over blocks, k larger than a
    block, a last block shorter than k."""
    monkeypatch.setattr(flat, "CACHE_BLOCK_BYTES", 1024)
    n = 256 * 9 + 3
    xb = np.zeros((n, 4), np.float32)
    xb[::5, 0] = 1.0  # hundreds of rows tie for first place
    xb[2::11, 1] = 2.0
    xq = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    check("faiss_blocked", xq, xb, 300)
    rng = np.random.default_rng(3)
    xb = rng.standard_normal((n, 16)).astype(np.float32)
    check("faiss_blocked", rng.standard_normal((5, 16)).astype(np.float32), xb, 10)


@pytest.mark.parametrize("kernel", KERNELS)
def test_k_larger_than_the_view_and_empty_views(kernel: str) -> None:
    rng = np.random.default_rng(1)
    xb = rng.standard_normal((7, 5)).astype(np.float32)
    xq = rng.standard_normal((4, 5)).astype(np.float32)
    check(kernel, xq, xb, 50)
    scores, pos = flat.search(kernel, xq, np.zeros((0, 5), np.float32), 10)
    assert scores.shape == pos.shape == (4, 0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_on_a_memory_map(tmp_path, kernel: str) -> None:
    rng = np.random.default_rng(2)
    np.save(tmp_path / "v.npy", rng.standard_normal((30_000, 32)).astype(np.float32))
    xb = np.load(tmp_path / "v.npy", mmap_mode="c")
    check(kernel, rng.standard_normal((9, 32)).astype(np.float32), xb, 10)


def test_the_router_measures_and_sets_the_blas_threshold_once() -> None:
    import faiss

    router = flat.Router()
    assert router.kernel_for(1) == "faiss" and router.kernel_for(8) == "faiss_blocked"  # before
    assert router.kernel_for(64) == "torch"
    router.calibrate(32, rows=4096, budget_s=0.002)
    assert set(router.table) == set(flat.CALIBRATION_SIZES)
    assert set(router.table.values()) <= set(KERNELS)
    assert all(rate > 0 for t in router.timings.values() for rate in t.values())
    threshold = faiss.cvar.distance_compute_blas_threshold
    if router.blas_from is None:
        assert threshold == flat.NEVER_BLAS
    else:
        assert threshold == router.blas_from * 32
    assert router.kernel_for(3) == router.table[2] and router.kernel_for(1000) == router.table[256]
    # FAISS takes its BLAS path from the threshold on: its blocked scan only runs below it
    if router.blas_from is not None:
        above = [b for b in router.table if b >= router.blas_from]
        assert all(router.table[b] != "faiss_blocked" for b in above)
