"""Micro-batching: concurrent submissions share one call; each gets its own result or error."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from app.services.batching import MicroBatcher, SearchItem, search_batcher
from indexer.search.specs import IndexSpec
from indexer.search.view import View
from models.heads import HClipHead
from models.limits import InputError


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


def test_a_tower_call_under_load_waits_for_the_clients_it_answered() -> None:
    """Six clients, each sending its next query a few ms after its answer: without the hold,
    the first one back goes alone and splits the rest; with it, every call takes all six."""

    def sizes(hold_share: float) -> list[int]:
        calls: list[int] = []

        def run(items: list[int]) -> list[int]:
            calls.append(len(items))
            time.sleep(0.05)  # a tower's call
            return items

        async def client(b: MicroBatcher[int, int], i: int) -> None:
            for _ in range(4):
                await b.submit(i)
                await asyncio.sleep(0.002 + 0.001 * i)  # the answer travels, the next is sent

        async def main() -> None:
            b = MicroBatcher(run, ThreadPoolExecutor(1), 64, 0.0, hold_share=hold_share)
            await asyncio.gather(*(client(b, i) for i in range(6)))

        asyncio.run(main())
        return calls

    assert sizes(0.25) == [6, 6, 6, 6]
    split = sizes(0.0)
    assert len(split) > 4 and 1 in split  # what the hold prevents


def test_the_hold_is_bounded_and_a_lone_query_is_never_held() -> None:
    """After a call of six, a lone query waits at most the hold's share of that call; a query
    after a call of one goes at once."""

    def run(items: list[int]) -> list[int]:
        time.sleep(0.2)
        return items

    async def main() -> tuple[float, float]:
        b = MicroBatcher(run, ThreadPoolExecutor(1), 64, 0.0, hold_share=0.25)
        await asyncio.gather(*(b.submit(i) for i in range(6)))
        t0 = time.perf_counter()
        await b.submit(7)  # held: up to 0.25 x 0.2 s for five more that never come
        after_burst = time.perf_counter() - t0
        t0 = time.perf_counter()
        await b.submit(8)  # the last call took one: no hold
        return after_burst, time.perf_counter() - t0

    after_burst, lone = asyncio.run(main())
    assert 0.2 + 0.02 < after_burst < 0.2 + 0.05 + 0.1, after_burst
    assert lone < 0.2 + 0.03, lone


def unit_head(dim: int) -> HClipHead:
    """An H-CLIP head whose omega is all ones: a view's query factor is the query's embedding."""
    head = HClipHead(["a", "b"], dim)
    with torch.no_grad():
        head.weight.fill_(1.0)
        head.logit_scale.fill_(0.0)
    return head


def item(x: np.ndarray, k: int) -> SearchItem:
    return SearchItem({"a": x}, k)


def test_search_batches_equal_one_by_one_searches() -> None:
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((500, 6)).astype(np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(500) * 2, 6, vectors=xb)
    sizes: list[int] = []
    xq = rng.standard_normal((12, 6)).astype(np.float32)

    async def main() -> list:
        b = search_batcher(view, unit_head(6), ThreadPoolExecutor(1), 64, 0.002, sizes.append)
        return await asyncio.gather(*(b.submit(item(xq[i], 3 + i % 4)) for i in range(12)))

    got = asyncio.run(main())
    assert sum(sizes) == 12 and len(sizes) < 12
    for i, (scores, rows) in enumerate(got):
        k = 3 + i % 4
        order = np.argsort(-(xb @ xq[i]))[:k]
        assert rows.tolist() == (order * 2).tolist()
        assert np.allclose(scores, (xb @ xq[i])[order], atol=1e-5)


@pytest.mark.parametrize("k", [1, 500, 600])
@pytest.mark.parametrize("queries", [1, 3])  # a lone query is scanned, a batch multiplied
def test_k_beyond_the_view_returns_what_there_is(k: int, queries: int) -> None:
    xb = np.eye(2, dtype=np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.array([7, 9]), 2, vectors=xb)
    _, rows = view.search(np.tile(np.array([[1.0, 0.5]], dtype=np.float32), (queries, 1)), k)
    assert rows.tolist() == [[7, 9][: min(k, 2)]] * queries


def test_a_query_whose_factor_overflows_fails_alone() -> None:
    xb = np.eye(2, dtype=np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.array([7, 9]), 2, vectors=xb)
    head = unit_head(2)
    with torch.no_grad():
        head.weight.fill_(1e30)  # omega * a query of 1e10 overflows float32

    async def main() -> list:
        b = search_batcher(view, head, ThreadPoolExecutor(1), 64, 0.002, lambda n: None)
        small, huge = np.array([1e-30, 0.0], np.float32), np.array([1e10, 1.0], np.float32)
        items = [item(small, 1), SearchItem({"a": huge}, 1, field="embeddings")]
        return await asyncio.gather(*(b.submit(it) for it in items), return_exceptions=True)

    ok, bad = asyncio.run(main())
    assert isinstance(bad, InputError) and str(bad).startswith("embeddings: the query's vector")
    assert ok[1].tolist() == [7]


def batched_searches(on_loop: bool) -> tuple[np.ndarray, np.ndarray, list, list[str], list[int]]:
    """A lone search, then nine at once, through a search batcher over 400 vectors: (xb, xq,
    the results, the threads its batches ran on, the batches' sizes)."""
    import threading

    rng = np.random.default_rng(2)
    xb = rng.standard_normal((400, 8)).astype(np.float32)
    view = View("a", ("a",), ("b",), IndexSpec("flat"), np.arange(400) * 3, 8, vectors=xb)
    xq = rng.standard_normal((10, 8)).astype(np.float32)
    threads: list[str] = []
    sizes: list[int] = []

    async def main() -> list:
        pool = ThreadPoolExecutor(1, thread_name_prefix="pool")
        b = search_batcher(view, unit_head(8), pool, 64, 0.0, sizes.append, on_loop=on_loop)
        batch = b.run_batch

        def recorded(items: list) -> list:
            threads.append(threading.current_thread().name)
            return batch(items)

        b.run_batch = recorded
        lone = await b.submit(item(xq[0], 4))
        many = await asyncio.gather(*(b.submit(item(xq[i], 4)) for i in range(1, 10)))
        return [lone, *many]

    return xb, xq, asyncio.run(main()), threads, sizes


def test_on_loop_runs_every_batch_on_the_event_loop_with_the_same_results() -> None:
    import threading

    xb, xq, got, threads, sizes = batched_searches(on_loop=True)
    assert set(threads) == {threading.main_thread().name}
    assert sizes[0] == 1 and sum(sizes) == 10 and len(sizes) < 10  # still batched
    for i, (scores, rows) in enumerate(got):
        order = np.argsort(-(xb @ xq[i]))[:4]
        assert rows.tolist() == (order * 3).tolist()
        assert np.allclose(scores, (xb @ xq[i])[order], atol=1e-5)
    _, _, off, threads, _ = batched_searches(on_loop=False)
    assert threads and all(t.startswith("pool") for t in threads)
    assert [r.tolist() for _, r in off] == [r.tolist() for _, r in got]


@pytest.mark.parametrize(
    ("mode", "one_per_core", "expected"),
    [("auto", True, True), ("auto", False, False), ("on", False, True), ("off", True, False)],
)
def test_searches_go_on_the_loop_when_each_worker_has_a_core(
    tmp_path, mode: str, one_per_core: bool, expected: bool
) -> None:
    import os

    from app.core.settings import Settings

    cores = len(os.sched_getaffinity(0))
    if not one_per_core and cores == 1:
        pytest.skip("one core: a single worker has it to itself")
    workers = cores if one_per_core else 1
    settings = Settings(root=tmp_path, workers=workers, search_on_loop=mode)
    assert settings.searches_on_loop() is expected


def test_searches_run_on_the_search_thread_batched_with_exact_results() -> None:
    xb, xq, got, threads, sizes = batched_searches(on_loop=False)
    assert threads and all(t.startswith("pool") for t in threads)
    assert sizes[0] == 1 and sum(sizes) == 10 and len(sizes) < 10  # batched
    for i, (scores, rows) in enumerate(got):
        order = np.argsort(-(xb @ xq[i]))[:4]
        assert rows.tolist() == (order * 3).tolist()
        assert np.allclose(scores, (xb @ xq[i])[order], atol=1e-5)


def test_thread_counts_default_to_each_workers_share_of_the_cores(tmp_path) -> None:
    from app.core.settings import Settings
    from models.machine import usable_cores

    cores = usable_cores()
    for workers in (1, 2, cores, 2 * cores):
        s = Settings(root=tmp_path, workers=workers)
        share = max(1, cores // workers)
        assert s.search_threads == s.encode_threads == share and s.shared_encode_threads
    assert Settings(root=tmp_path, workers=1, faiss_threads=3).search_threads == 3
    fixed = Settings(root=tmp_path, workers=2, torch_threads=3)
    assert fixed.encode_threads == 3 and not fixed.shared_encode_threads


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
