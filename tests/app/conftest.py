"""The real app under uvicorn on a loopback port, against real indexes and real Redis."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.core.settings import Settings
from app.main import create_app
from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl

if TYPE_CHECKING:
    from benchmarks.milvus_servers import Standalone


@pytest.fixture(scope="session")
def milvus_standalone(tmp_path_factory) -> Iterator[Standalone]:
    """One Milvus standalone for the session (the `milvus` package's Go/C++ engine, on free
    ports, in a directory of the session's), stopped at its end."""
    pytest.importorskip("milvus", reason="the 'milvus-server' extra (CI installs it)")
    from benchmarks.milvus_servers import standalone

    with standalone(tmp_path_factory.mktemp("milvus-standalone")) as server:
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(
    settings: Settings, wait_ready: bool = True, app: FastAPI | None = None
) -> Iterator[httpx.Client]:
    """Starts uvicorn in a thread (with `app`, or the app `settings` make); yields a client for
    it; stops it on exit."""
    port = free_port()
    config = uvicorn.Config(
        app or create_app(settings),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20)
    try:
        if wait_ready:
            wait_until(lambda: client.get("/readyz").status_code == 200)
        yield client
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=20)


def wait_until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def settings_for(root: Path, **kw) -> Settings:
    base = {
        "root": root,
        "poll_interval_s": 0.1,
        "cache_prefix": f"hclip-test:{uuid.uuid4().hex}",
    }
    return Settings(**(base | kw))


def build_index(root: Path, model: Path, rows: list[dict], tmp: Path, *extra: str) -> str:
    path = tmp / f"records-{uuid.uuid4().hex}.jsonl"
    write_jsonl(path, rows)
    assert index_build(model, path, root, *extra) == 0
    return (root / "CURRENT").read_text().strip()


def records_v(prefix: str, n: int = 300, seed: int = 0) -> list[dict]:
    rows = vector_records(n, DIMS, seed=seed, k=40)
    for i, r in enumerate(rows):
        r["id"] = f"{prefix}-{i}"
        r["payload"]["version_tag"] = prefix
        if i % 10 == 0:
            r.pop("c")
    return rows


@pytest.fixture(scope="module")
def vector_index(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("vindex")
    model = make_model_dir(tmp / "model")
    rows = records_v("v1")
    build_index(tmp / "root", model, rows, tmp)
    return tmp / "root", model, rows


@contextlib.contextmanager
def private_redis(port: int) -> Iterator[subprocess.Popen]:
    """A Redis server of the test's own, which it may stop and start at will."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (CI installs it)")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        wait_until(lambda: _pings(redis.Redis(port=port)))
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False
