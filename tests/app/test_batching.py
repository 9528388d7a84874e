"""Micro-batching: concurrent submissions share one call; each gets its own result or error."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from app.batching import MicroBatcher, SearchItem, search_batcher
from indexer.reader import View
from indexer.specs import IndexSpec


def test_concurrent_submissions_are_gathered() -> None:
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[int | Exception]:
        calls.append(items)
        time.sleep(0.05)  # a slow call: the others queue up meanwhile
        return [ValueError(f"bad {i}") if i == 13 else i * 10 for i in items]

    async def main() -> list[object]:
        b = MicroBatcher(run, ThreadPoolExecutor(1), max_batch=8, wait_s=0.0)
        return await asyncio.gather(*(b.submit(i) for i in range(20)), return_exceptions=True)

    results = asyncio.run(main())
    assert [len(c) for c in calls] == [8, 8, 4]  # those queued while a call runs go together
    assert sorted(i for c in calls for i in c) == list(range(20))
    assert results[:13] == [i * 10 for i in range(13)] and results[14] == 140
    assert isinstance(results[13], ValueError)  # only the bad item fails


def test_a_failing_call_fails_only_the_item_that_broke_it() -> None:
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[int | Exception]:
        calls.append(items)
        if 3 in items:
            raise RuntimeError("boom")
        return list(items)

    async def main() -> list[object]:
        b = MicroBatcher(run, None, max_batch=4, wait_s=0.0)
        first = await asyncio.gather(*(b.submit(i) for i in (3, 4)), return_exceptions=True)
        return [*first, await b.submit(5)]

    r = asyncio.run(main())
    assert isinstance(r[0], RuntimeError) and r[1:] == [4, 5]
    assert calls == [[3, 4], [3], [4], [5]]  # the batch failed, then each item alone


@pytest.mark.parametrize("kernel", ["faiss", "torch", "numpy"])
def test_search_batches_equal_one_by_one_searches(kernel: str) -> None:
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((500, 6)).astype(np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(500) * 2, 6, vectors=xb)
    sizes: list[int] = []
    xq = rng.standard_normal((12, 6)).astype(np.float32)

    async def main() -> list:
        b = search_batcher(
            view, ThreadPoolExecutor(1), 64, 0.002, sizes.append, kernel_for=lambda n: kernel
        )
        return await asyncio.gather(*(b.submit(SearchItem(xq[i], 3 + i % 4)) for i in range(12)))

    got = asyncio.run(main())
    assert sum(sizes) == 12 and len(sizes) < 12
    for i, (scores, rows) in enumerate(got):
        k = 3 + i % 4
        order = np.argsort(-(xb @ xq[i]))[:k]
        assert rows.tolist() == (order * 2).tolist()
        assert np.allclose(scores, (xb @ xq[i])[order], atol=1e-5)


@pytest.mark.parametrize("k", [1, 500, 600])
@pytest.mark.parametrize("kernel", ["faiss", "torch", "numpy"])
def test_k_beyond_the_view_returns_what_there_is(k: int, kernel: str) -> None:
    xb = np.eye(2, dtype=np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.array([7, 9]), 2, vectors=xb)
    _, rows = view.search(np.array([[1.0, 0.5]], dtype=np.float32), k, kernel)
    assert rows.tolist() == [[7, 9][: min(k, 2)]]


def test_a_lone_search_scans_on_two_threads_and_a_busy_server_follows_the_router(
    tmp_path,
) -> None:
    import os

    from app.metrics import Metrics
    from app.serving import VersionManager
    from app.settings import Settings
    from app.workers import WorkerPools
    from indexer import flat

    router = flat.Router(table={1: "faiss", 2: "faiss_blocked"})

    def view(rows: int) -> View:
        xb = np.zeros((rows, 4), np.float32)
        return View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(rows), 4, vectors=xb)

    pools = WorkerPools(1, 1)
    try:
        manager = VersionManager(Settings(root=tmp_path), Metrics(), pools)
        alone = manager._splits(router, view(flat.HALVES_MIN_ROWS))
        kernel_for = manager._kernels(router, alone)
        manager.searches_in_flight = 1  # this search alone
        two_cores = len(os.sched_getaffinity(0)) >= 2
        assert alone() == two_cores
        assert kernel_for(1) == ("faiss_halves" if two_cores else "faiss")
        assert kernel_for(2) == "faiss_blocked"
        manager.searches_in_flight = 2  # another search under way: one thread each
        assert not alone() and kernel_for(1) == "faiss"
        manager.searches_in_flight = 1
        assert not manager._splits(router, view(100))()  # too small to split
        assert not manager._splits(None, view(flat.HALVES_MIN_ROWS))()  # approximate
        off = VersionManager(Settings(root=tmp_path, split_lone_search=False), Metrics(), pools)
        assert not off._splits(router, view(flat.HALVES_MIN_ROWS))()
    finally:
        pools.shutdown()


def test_a_lone_plain_search_runs_on_the_event_loop_and_others_on_the_executor() -> None:
    import threading

    rng = np.random.default_rng(1)
    xb = rng.standard_normal((300, 4)).astype(np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(300), 4, vectors=xb)
    threads: list[str] = []
    solo = [True]

    def kernel_for(n: int) -> str:
        threads.append(threading.current_thread().name)
        return "faiss"

    async def main() -> None:
        b = search_batcher(
            view, ThreadPoolExecutor(1, thread_name_prefix="pool"), 64, 0.0, lambda n: None,
            kernel_for=kernel_for, alone=lambda: solo[0],
        )  # fmt: skip
        await b.submit(SearchItem(xb[0], 3))  # alone: on the loop
        solo[0] = False
        await b.submit(SearchItem(xb[1], 3))  # not alone: on the executor
        solo[0] = True
        await asyncio.gather(*(b.submit(SearchItem(xb[i], 3)) for i in range(4)))  # a batch

    asyncio.run(main())
    main_thread = threading.main_thread().name
    assert threads[0] == main_thread
    assert threads[1].startswith("pool") and threads[2].startswith("pool")


def test_on_loop_runs_every_batch_on_the_event_loop_with_the_same_results() -> None:
    import threading

    rng = np.random.default_rng(2)
    xb = rng.standard_normal((400, 8)).astype(np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(400) * 3, 8, vectors=xb)
    xq = rng.standard_normal((10, 8)).astype(np.float32)
    threads: list[str] = []
    sizes: list[int] = []

    def kernel_for(n: int) -> str:
        threads.append(threading.current_thread().name)
        return "faiss_blocked" if n > 1 else "faiss"

    async def main() -> list:
        b = search_batcher(
            view, ThreadPoolExecutor(1, thread_name_prefix="pool"), 64, 0.0, sizes.append,
            kernel_for=kernel_for, on_loop=lambda: True,
        )  # fmt: skip
        lone = await b.submit(SearchItem(xq[0], 4))
        many = await asyncio.gather(*(b.submit(SearchItem(xq[i], 4)) for i in range(1, 10)))
        return [lone, *many]

    got = asyncio.run(main())
    assert set(threads) == {threading.main_thread().name}
    assert sizes[0] == 1 and sum(sizes) == 10 and len(sizes) < 10  # still batched
    for i, (scores, rows) in enumerate(got):
        order = np.argsort(-(xb @ xq[i]))[:4]
        assert rows.tolist() == (order * 3).tolist()
        assert np.allclose(scores, (xb @ xq[i])[order], atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "one_per_core", "expected"),
    [("auto", True, True), ("auto", False, False), ("on", False, True), ("off", True, False)],
)
def test_searches_go_on_the_loop_when_each_worker_has_a_core_once_measured(
    tmp_path, mode: str, one_per_core: bool, expected: bool
) -> None:
    import os
    import threading

    from app.metrics import Metrics
    from app.serving import VersionManager
    from app.settings import Settings
    from app.workers import WorkerPools

    cores = len(os.sched_getaffinity(0))
    if not one_per_core and cores == 1:
        pytest.skip("one core: a single worker has it to itself")
    workers = cores if one_per_core else 1
    pools = WorkerPools(1, 1)
    try:
        settings = Settings(root=tmp_path, workers=workers, search_on_loop=mode)
        manager = VersionManager(settings, Metrics(), pools)
        gate = threading.Event()
        manager._calibrations.append(pools.faiss.submit(gate.wait, 30))  # a measurement running
        on_loop = manager._on_loop()
        assert on_loop() is False  # nothing runs beside a measurement
        gate.set()
        pools.faiss.submit(lambda: None).result(5)
        assert on_loop() is expected
    finally:
        pools.shutdown()


def test_the_server_holds_numpys_blas_to_the_search_thread_count(tmp_path) -> None:
    import os

    import threadpoolctl

    from tests.app.conftest import running, settings_for

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: numpy's BLAS starts with one thread anyway")

    def pthreads_blas() -> list[int]:  # process-wide pools (an OpenMP one follows each thread)
        info = threadpoolctl.threadpool_info()
        return [i["num_threads"] for i in info if i.get("threading_layer") == "pthreads"]

    with running(settings_for(tmp_path / "root", faiss_threads=1), wait_ready=False):
        assert pthreads_blas() and set(pthreads_blas()) == {1}, pthreads_blas()
