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


# -- ready means able to answer: the served version's files gone, CURRENT naming no version ---


def test_a_version_removed_while_it_serves_is_reported_and_the_previous_one_serves(
    tmp_path: Path, vector_index
) -> None:
    import shutil

    from tests.app.conftest import running, settings_for, wait_until

    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = build_index(root, model_dir, records_v("v1", n=200), tmp_path)
    v2 = build_index(root, model_dir, records_v("v2", n=200, seed=1), tmp_path)
    with running(settings_for(root)) as client:
        assert client.get("/readyz").json()["index_version"] == v2
        shutil.rmtree(root / "versions" / v2)  # its memory maps would go on answering
        wait_until(lambda: client.get("/readyz").json().get("index_version") == v1, 10)
        ready = client.get("/readyz").json()
        assert f"names '{v2}', which is not in versions" in ready["warning"], ready
        info = client.get("/v1/info").json()
        assert info["index_version"] == v1
        assert [r["version"] for r in info["rejected_versions"]] == [v2]
        body = {"query": {"a": [0.1] * DIMS["a"]}, "k": 3}
        hits = client.post("/v1/search", json=body).json()
        assert hits["index_version"] == v1 and hits["results"][0]["id"].startswith("v1-")


def test_the_only_version_removed_is_not_ready_and_says_why_at_once(
    tmp_path: Path, vector_index
) -> None:
    """Every worker, the one that served it and one started after: /readyz 503 naming the
    version gone, and a search refused at once with that reason (no wait for a version
    'being loaded')."""
    import shutil

    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = build_index(root, model_dir, records_v("v1", n=200), tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(root, port, workers=2)
    try:
        wait_ready(url, proc)
        shutil.rmtree(root / "versions" / v1)
        deadline = time.monotonic() + 10
        seen: set[str] = set()
        while time.monotonic() < deadline and len(seen) < 2:  # both workers say so
            with httpx.Client(base_url=url, timeout=5) as c:
                r = c.get("/readyz")
            if r.status_code == 503 and f"names '{v1}', which is not in versions" in r.text:
                seen.add(r.headers["x-hclip-instance"])
            time.sleep(0.05)
        assert len(seen) == 2, seen
        t0 = time.monotonic()
        status, _ = search(url, 1)
        assert status == 503 and time.monotonic() - t0 < 2.0
        with httpx.Client(base_url=url, timeout=20) as c:
            r = c.post("/v1/search", json={"query": {"a": [0.1] * DIMS["a"]}, "k": 3})
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready"
        assert "no other version" in r.json()["error"] and "being loaded" not in r.text
    finally:
        stop(proc)


def test_current_naming_garbage_or_a_path_outside_the_root_is_refused(
    tmp_path: Path, vector_index
) -> None:
    """A cold start: CURRENT naming a path to another root's version serves none of it, but
    the root's own newest version, saying why; CURRENT naming nothing at all is not ready,
    saying why, not 'being loaded'."""
    from indexer.store import artifact
    from tests.app.conftest import running, settings_for, wait_until

    _, model_dir, _ = vector_index
    other = build_index(tmp_path / "otherroot", model_dir, records_v("x", n=100), tmp_path)
    root = tmp_path / "root"
    v1 = build_index(root, model_dir, records_v("v1", n=100), tmp_path)
    artifact.write_current(root, f"../../otherroot/versions/{other}")
    assert (artifact.version_dir(root, artifact.read_current(root) or "")).is_dir()
    with running(settings_for(root)) as client:
        ready = client.get("/readyz").json()
        assert ready["index_version"] == v1, ready
        assert "which is not a version name" in ready["warning"]
    solo = tmp_path / "solo"
    (solo / "versions").mkdir(parents=True)
    (solo / "CURRENT").write_bytes(b"\xff\xfe garbage\n")
    with running(settings_for(solo), wait_ready=False) as client:
        wait_until(lambda: client.get("/readyz").status_code == 503)
        r = client.get("/readyz").json()
        assert "CURRENT names" in r["error"] and "no other version in" in r["error"], r
        assert "being loaded" not in r["error"]
