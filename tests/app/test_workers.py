"""`hclip serve --workers 2`: both workers answer, with the same results; each swaps versions by
itself; /metrics counts every worker's requests whichever worker renders it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from app.server.serve import HEALTHCHECK_S
from indexer.store import artifact
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.app.conftest import build_index, free_port, records_v, wait_until
from tests.app.test_search import reference

REPO = Path(__file__).resolve().parents[2]


def fresh(url: str, method: str, path: str, **kw) -> httpx.Response:
    """One request on a new connection: the kernel hands each accept to either worker."""
    with httpx.Client(base_url=url, timeout=20) as c:
        return c.request(method, path, **kw)


@pytest.fixture
def two_workers(tmp_path: Path, vector_index):
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    build_index(root, model_dir, records_v("v1"), tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "HCLIP_POLL_INTERVAL_S": "0.1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("HCLIP_REDIS_URL", None)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", "2"]
    cmd += ["--root", str(root), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    ready_workers: set[str] = set()

    def both_ready() -> bool:
        try:
            r = fresh(url, "GET", "/readyz")
        except httpx.HTTPError:
            return False
        if r.status_code == 200:
            ready_workers.add(r.headers["x-hclip-instance"])
        return len(ready_workers) == 2

    try:
        wait_until(both_ready, timeout=60)
        yield url, root, model_dir, tmp_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        assert proc.returncode == 0, err[-2000:]
        # each worker logs its own lines (a fresh interpreter: uvicorn sets its logging up)
        started = len(re.findall(r"uvicorn\.error: Started server process \[\d+\]", err))
        assert started >= 2 and err.count("INFO app.main: index root") == started, err[-2000:]
        metrics_dirs = re.findall(r"PROMETHEUS_MULTIPROC_DIR=(\S+)", err)
        assert all(not Path(d).exists() for d in metrics_dirs)


def test_two_workers_serve_swap_and_count(two_workers) -> None:
    url, root, model_dir, tmp_path = two_workers
    version = LoadedVersion(artifact.current_version_dir(root))
    model = load_model(model_dir)
    probes = records_v("x", n=30, seed=5)
    seen: set[str] = set()
    sent = 0
    for i in range(60):
        query = {"a": probes[i % 30]["a"], "b": probes[i % 30]["b"]}
        r = fresh(url, "POST", "/v1/search", json={"query": query, "k": 5})
        sent += 1
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-hclip-instance"])
        ids, _ = reference(version, model, query, 5)
        assert [h["id"] for h in r.json()["results"]] == ids
        if len(seen) == 2 and i >= 20:
            break
    assert len(seen) == 2, seen  # both workers answered

    # counters are summed over the workers, whichever one renders /metrics
    for _ in range(4):
        text = fresh(url, "GET", "/metrics").text
        got = re.search(
            r'hclip_requests_total\{endpoint="/v1/search",method="POST",status="200"\} (\S+)', text
        )
        assert got is not None and float(got.group(1)) == sent

    v2 = build_index(root, model_dir, records_v("v2", seed=1), tmp_path)
    updated: set[str] = set()

    def both_swapped() -> bool:
        r = fresh(url, "GET", "/readyz")
        if r.json()["index_version"] == v2:
            updated.add(r.headers["x-hclip-instance"])
        return updated == seen

    wait_until(both_swapped, timeout=30)
    # every worker reports the new version as loaded, and none the old one any more
    text = fresh(url, "GET", "/metrics").text
    loaded = re.findall(r'hclip_index_version_info\{[^}]*version="([^"]+)"[^}]*\} (\S+)', text)
    assert sorted(v for v, value in loaded if float(value) == 1) == [v2, v2], loaded
    r = fresh(url, "POST", "/v1/search", json={"query": {"a": probes[0]["a"]}, "k": 3})
    assert {h["payload"]["version_tag"] for h in r.json()["results"]} == {"v2"}


def listening_sockets(port: int) -> int:
    """TCP sockets in LISTEN state on `port` (/proc/net/tcp, state 0A)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += int(local.split(":")[1], 16) == port and state == "0A"
    return count


def test_a_burst_of_connections_is_spread_over_the_workers(two_workers) -> None:
    """32 connections opened at once: on one shared socket the worker woken first could take
    them all; on a socket of each worker's own (SO_REUSEPORT) the kernel spreads them."""
    url = two_workers[0]
    port = int(url.rsplit(":", 1)[1])
    assert listening_sockets(port) == 2
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
    try:
        for s in sockets:  # every connection is accepted before any is answered
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        answered_by = {}
        for k, s in enumerate(sockets):
            head = s.recv(65536).split(b"\r\n\r\n", 1)[0].decode().lower()
            answered_by[k] = next(
                line.split(":", 1)[1].strip()
                for line in head.splitlines()
                if line.startswith("x-hclip-instance:")
            )
    finally:
        for s in sockets:
            s.close()
    per_worker = Counter(answered_by.values())
    assert len(per_worker) == 2, per_worker


def test_each_worker_listens_on_its_own_socket_and_a_dead_one_is_replaced(two_workers) -> None:
    url = two_workers[0]
    port = int(url.rsplit(":", 1)[1])
    assert listening_sockets(port) == 2  # one per worker (app/server/worker_sockets.py)

    instances: set[str] = set()
    wait_until(lambda: instances.add(fresh(url, "GET", "/readyz").headers["x-hclip-instance"])
               or len(instances) == 2)  # fmt: skip
    victim = sorted(instances)[0]
    os.kill(int(victim.rsplit("-", 1)[1]), signal.SIGKILL)

    def replaced() -> bool:
        try:
            r = fresh(url, "GET", "/readyz")
        except httpx.HTTPError:  # a connection the dead worker had queued
            return False
        if r.status_code == 200:
            instances.add(r.headers["x-hclip-instance"])
        return len(instances) == 3 and listening_sockets(port) == 2

    # uvicorn's manager pings each worker every 0.5 s; a worker killed while a ping is in flight
    # is only found dead when the ping times out (the manager holds the pipe's other end too),
    # HEALTHCHECK_S later: its replacement may come that late, then takes its start-up time
    wait_until(replaced, timeout=HEALTHCHECK_S + 60)
    query = {"a": records_v("q", n=1)[0]["a"]}
    for _ in range(10):  # both workers answer every request
        assert fresh(url, "POST", "/v1/search", json={"query": query}).status_code == 200
    text = fresh(url, "GET", "/metrics").text
    assert "hclip_index_version_info{" in text


def test_a_port_already_taken_is_a_clear_error(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", "2", "--port", str(port)]
        cmd += ["--root", str(tmp_path)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in done.stderr


def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    build_index(root, model_dir, records_v("v1"), tmp_path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HCLIP_REDIS_URL", None)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", "2"]
    cmd += ["--root", str(root), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    workers: set[int] = set()
    try:

        def both_ready() -> bool:
            try:
                r = fresh(url, "GET", "/readyz")
            except httpx.HTTPError:
                return False
            workers.add(int(r.headers["x-hclip-instance"].rsplit("-", 1)[1]))
            return len(workers) == 2

        wait_until(both_ready, timeout=60)
        proc.kill()  # SIGKILL: the supervisor cannot stop its workers itself
        proc.wait(10)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            # a worker that has exited but is not reaped yet (its parent is gone: init reaps)
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

        wait_until(lambda: all(gone(pid) for pid in workers), timeout=40)
        assert listening_sockets(port) == 0
    finally:
        proc.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
