"""Ready means ready: once /readyz first answers 200, no search gets a 503 for the published
version, from any worker, at start-up or while a killed worker is restarted."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from tests.app.conftest import build_index, free_port, records_v
from tests.conftest import DIMS

REPO = Path(__file__).resolve().parents[2]


def start_server(root: Path, port: int, workers: int, poll_s: float = 0.2) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HCLIP_POLL_INTERVAL_S": str(poll_s)}
    env.pop("HCLIP_REDIS_URL", None)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    cmd += ["--root", str(root), "--port", str(port)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise AssertionError("never ready")


def search(url: str, i: int) -> tuple[int, str]:
    """(status, instance) of one search on a new connection (so that either worker may take
    it); a connection refused or reset (a worker killed under it) is retried, as the client
    and a load balancer do: what is counted is what the service answers."""
    rng = np.random.default_rng(i)
    body = {"query": {"a": rng.standard_normal(DIMS["a"]).tolist()}, "k": 5}
    for _ in range(50):
        try:
            with httpx.Client(base_url=url, timeout=20) as c:
                r = c.post("/v1/search", json=body)
            return r.status_code, r.headers.get("x-hclip-instance", "")
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"search {i}: no answer")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def two_ready_workers(tmp_path: Path, vector_index) -> Iterator[str]:
    """`hclip serve --workers 2` on a fresh 3,000-record version, from the moment /readyz first
    answers 200; its URL."""
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    build_index(root, model_dir, records_v("v1", n=3000), tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(root, port, workers=2)
    try:
        wait_ready(url, proc)
        yield url
    finally:
        stop(proc)


def test_no_503_once_ready_with_two_workers(tmp_path: Path, vector_index) -> None:
    with two_ready_workers(tmp_path, vector_index) as url:
        with ThreadPoolExecutor(32) as pool:  # 200 searches at once, the moment it is ready
            answers = list(pool.map(lambda i: search(url, i), range(200)))
        statuses = Counter(s for s, _ in answers)
        assert statuses == Counter({200: 200}), statuses
        assert len({who for _, who in answers}) == 2  # both workers answered


def worker_pids(instances: set[str]) -> set[int]:
    return {int(who.rsplit("-", 1)[1]) for who in instances}


def test_no_503_while_a_killed_worker_is_restarted(tmp_path: Path, vector_index) -> None:
    with two_ready_workers(tmp_path, vector_index) as url:
        before = {who for _, who in (search(url, i) for i in range(40))}
        assert len(before) == 2
        victim = min(worker_pids(before))
        with ThreadPoolExecutor(8) as pool:  # a bounded load: 600 searches from 8 clients
            futures = [pool.submit(search, url, i) for i in range(600)]
            time.sleep(0.3)
            os.kill(victim, signal.SIGKILL)
            answers = [f.result() for f in futures]
        statuses = Counter(s for s, _ in answers)
        assert statuses == Counter({200: 600}), statuses
        deadline = time.monotonic() + 60
        after: set[str] = set()
        while len(worker_pids(after) - {victim}) < 2 and time.monotonic() < deadline:
            after |= {who for _, who in (search(url, 10_000 + i) for i in range(20))}
        assert len(worker_pids(after) - {victim}) == 2, after  # the restarted worker serves


def test_a_request_waits_for_a_published_version_its_worker_is_still_loading(
    tmp_path: Path, vector_index
) -> None:
    """A worker that started before the first version was published loads it at its next
    poll; a search that reaches it meanwhile waits for that load, bounded by its deadline,
    instead of answering 503 for a version that is there. With nothing published it does not
    wait."""
    import asyncio

    from app.core.metrics import Metrics
    from app.services.threads import WorkerPools
    from app.services.versions import VersionManager
    from tests.app.conftest import settings_for

    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    root.mkdir()

    async def main() -> None:
        pools = WorkerPools(1, 1)
        vm = VersionManager(settings_for(root), Metrics(), pools)
        try:
            t0 = time.monotonic()
            assert await vm.wait_serving(5.0) is None  # nothing published: no waiting
            assert time.monotonic() - t0 < 1.0
            version = build_index(root, model_dir, records_v("v1", n=300), tmp_path)
            waiting = asyncio.create_task(vm.wait_serving(30.0))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # published, not loaded here yet: it waits
            assert await vm.refresh()  # this worker's next poll
            got = await waiting
            assert got is not None and got.version == version
        finally:
            pools.shutdown()

    asyncio.run(main())
