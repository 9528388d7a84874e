"""The compose topology as local processes: two api replicas sharing Redis and one index root,
behind Debian's HAProxy running docker/haproxy.cfg (its server list pointed at the replicas).
Requests spread over both replicas, and survive one replica being killed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import build_index, free_port, private_redis, records_v, wait_until
from tests.conftest import make_model_dir
from tests.deploy.dockerfiles import REPO

CONFIG = REPO / "docker" / "haproxy.cfg"


def haproxy() -> str:
    path = shutil.which("haproxy")
    if path is None:
        pytest.fail("haproxy is not installed (scripts/test.sh installs it)")
    return path


def local_config(lb_port: int, replicas: dict[str, int]) -> str:
    """docker/haproxy.cfg with loopback addresses instead of Docker's DNS."""
    text = CONFIG.read_text()
    servers = "\n".join(
        f"    server {name} 127.0.0.1:{port} check" for name, port in replicas.items()
    )
    for block, body in (
        ("RESOLVERS", ""),
        ("BIND", f"    bind 127.0.0.1:{lb_port}"),
        ("SERVERS", servers),
    ):
        text, n = re.subn(
            rf"( *)# BEGIN {block}\n.*?# END {block}\n", body + "\n", text, flags=re.S
        )
        assert n == 1, block
    return text


def test_the_config_is_valid() -> None:
    r = subprocess.run([haproxy(), "-c", "-f", str(CONFIG)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_requests_spread_over_replicas_and_survive_a_kill(tmp_path: Path) -> None:
    rows = records_v("v1")
    root = tmp_path / "root"
    build_index(root, make_model_dir(tmp_path / "model"), rows, tmp_path)
    redis_port, lb_port = free_port(), free_port()
    replicas = {"api1": free_port(), "api2": free_port()}
    procs: dict[str, subprocess.Popen] = {}
    with private_redis(redis_port):
        for name, port in replicas.items():
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "HCLIP_ROOT": str(root),
                "HCLIP_PORT": str(port),
                "HCLIP_INSTANCE": name,
                "HCLIP_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                "HCLIP_WORKERS": "1",  # one process a replica: a SIGKILL ends it at once
            }
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "serve"],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(local_config(lb_port, replicas))
        lb = subprocess.Popen(
            [haproxy(), "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{lb_port}"
        try:
            for port in replicas.values():
                wait_until(lambda p=port: _ready(f"http://127.0.0.1:{p}"), timeout=60)
            time.sleep(2.5)  # HAProxy's first health checks: both replicas up

            def search(i: int, client: httpx.Client) -> httpx.Response:
                body = {"query": {"a": rows[i % len(rows)]["a"]}, "k": 3 + i % 5}
                return client.post("/v1/search", json=body)

            seen: Counter[str] = Counter()
            with httpx.Client(base_url=url, timeout=10) as client:
                for i in range(40):
                    r = search(i, client)
                    assert r.status_code == 200, r.text
                    seen[r.headers["x-hclip-instance"]] += 1
            assert set(seen) == set(replicas), seen  # both replicas served
            assert min(seen.values()) >= 5, seen

            procs["api1"].send_signal(signal.SIGKILL)
            procs["api1"].wait()
            after: Counter[str] = Counter()
            with httpx.Client(base_url=url, timeout=10) as client:
                for i in range(40, 120):
                    r = search(i, client)
                    assert r.status_code == 200, (i, r.status_code, r.text)
                    after[r.headers["x-hclip-instance"]] += 1
            assert after == Counter({"api2": 80})  # every request answered, by the survivor
        finally:
            lb.send_signal(signal.SIGTERM)
            lb.wait(10)
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
