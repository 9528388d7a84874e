"""`hclip serve` says where it looks for versions: a missing root is an error naming it, and an
empty one is said to be empty, with the command that publishes a version, in the log at once
and in /readyz's 503."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.app.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_root_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "root"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--root", str(missing)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"the index root {missing} does not exist" in done.stderr
    assert "hclip index build" in done.stderr and "Traceback" not in done.stderr


def test_an_empty_root_says_so_at_once_and_in_readyz(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--root", "empty", "--port", str(port),
         "--workers", "1"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        url = f"http://127.0.0.1:{port}"
        said, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 0.2)[0]:
                said += proc.stderr.readline()
            if "Application startup complete" in said:
                break
        hint = f"no index version is published in {root.resolve()} yet"
        # the hint is logged before the server takes a connection: within a second of it
        assert hint in said and f"--root {root.resolve()}" in said, said
        r = httpx.get(url + "/readyz", timeout=10)
        assert r.status_code == 503 and hint in r.json()["error"]
        assert r.headers["retry-after"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
