"""Milvus servers of one's own on loopback ports, for the tests and benchmarks of the milvus
backend (docs/milvus.md): Milvus Lite (`milvus-lite server`, the `milvus` extra), and Milvus
standalone, the Go/C++ engine with Knowhere that the PyPI package `milvus` starts from Python
without Docker (the `milvus-server` extra).

    with standalone(Path("milvus-data"), authorization=True) as server:
        print(server.uri)  # http://127.0.0.1:PORT; the user root, password Milvus

The package runs Milvus with an embedded etcd whose client and peer ports (2379, 2380) its own
configuration cannot move; here they are free ports of the server's own, set through the etcd
configuration file Milvus reads (`etcd.config.path`), so that two servers can run on one
machine and a stopped one comes back on the same ports.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300.0  # a cold start unpacks the binaries; a shared 2-core machine is slow
ROOT_TOKEN = "root:Milvus"  # the user Milvus creates when authorization is enabled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not listening(port):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:g} s")
        time.sleep(0.1)


class Lite:
    """`milvus-lite server` (Milvus Lite) with its data in `data`, on a free loopback port it
    keeps across stop() and start()."""

    def __init__(self, data: Path, port: int | None = None):
        self.data = data
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(self.data),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_listening(self.port, self.proc, "milvus-lite server", timeout_s)

    @property
    def running(self) -> subprocess.Popen:
        """Its process, while it runs."""
        if self.proc is None:
            raise RuntimeError(f"milvus-lite server on port {self.port}: not started")
        return self.proc

    def stop(self) -> None:
        """Kill it: its data stays."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def lite(data: Path, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A started Milvus Lite server: (its URI, its process), killed on exit."""
    server = Lite(data, port)
    try:
        server.start()
        yield server.uri, server.running
    finally:
        server.stop()


class Standalone:
    """A Milvus standalone of the `milvus` package in `base` (its binaries, configuration,
    logs and data), on free loopback ports it keeps across stop() and start()."""

    def __init__(self, base: Path, authorization: bool = False):
        from milvus import MilvusServer, MilvusServerConfig

        self.base = base
        self.authorization = authorization
        self.port = free_port()
        etcd_client, etcd_peer = free_port(), free_port()
        base.mkdir(parents=True, exist_ok=True)
        etcd_yaml = base / "etcd.yaml"
        etcd_yaml.write_text(
            "name: default\n"
            f"listen-client-urls: http://127.0.0.1:{etcd_client}\n"
            f"advertise-client-urls: http://127.0.0.1:{etcd_client}\n"
            f"listen-peer-urls: http://127.0.0.1:{etcd_peer}\n"
            f"initial-advertise-peer-urls: http://127.0.0.1:{etcd_peer}\n"
            f"initial-cluster: default=http://127.0.0.1:{etcd_peer}\n"
        )

        class Config(MilvusServerConfig):
            def write_config(self) -> None:
                """The package's configuration, its embedded etcd pointed at etcd.yaml."""
                super().write_config()
                path = Path(self.base_data_dir, "configs", "milvus.yaml")
                text = path.read_text()
                etcd = f"\netcd:\n  config:\n    path: {etcd_yaml}\n"
                if "\netcd:\n" not in text:
                    raise RuntimeError(f"{path}: no etcd section to point at {etcd_yaml}")
                path.write_text(text.replace("\netcd:\n", etcd, 1))

            def try_bind_port(self, port: int) -> socket.socket | None:
                """The package's check that a port is free, with SO_REUSEADDR as the server
                binds it: a port a stopped server left in TIME_WAIT is free to start on."""
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                    sock.listen()
                    return sock
                except OSError:
                    sock.close()
                    return None

        self.server: Any = MilvusServer(Config(), proxy_port=self.port, etcd_port=etcd_client)
        self.server.set_base_dir(str(base))
        self.server.config.set("authorization_enabled", authorization)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return ROOT_TOKEN if self.authorization else ""

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start it and wait until a client's call is answered (the package's own wait, on
        its health route, would outlast a server that died starting)."""
        from pymilvus import MilvusClient

        self.server.wait_for_started = False
        self.server.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client = MilvusClient(uri=self.uri, token=self.token, timeout=5)
                client.list_collections()
                client.close()
                return
            except Exception as exc:
                code = self.server.server_proc.poll()
                if code is not None or time.monotonic() > deadline:
                    why = f"exited with status {code}" if code is not None else "does not answer"
                    raise RuntimeError(
                        f"Milvus standalone in {self.base} {why} on {self.uri} ({exc}); its "
                        f"logs: {self.base / 'logs'}"
                    ) from None
                time.sleep(0.5)

    def empty(self) -> None:
        """Drop every collection and alias: one that stays up for other tests idles with
        nothing loaded (a few percent of a core)."""
        from pymilvus import MilvusClient

        client = MilvusClient(uri=self.uri, token=self.token, timeout=60)
        for name in client.list_collections():
            for alias in client.list_aliases(name)["aliases"]:
                client.drop_alias(alias)
            client.drop_collection(name)
        client.close()

    def stop(self) -> None:
        """Stop it (the package sends SIGTERM, then SIGKILL after a second): its data stays."""
        self.server.stop()


@contextlib.contextmanager
def standalone(base: Path, authorization: bool = False) -> Iterator[Standalone]:
    """A started Milvus standalone in `base`, stopped on exit."""
    server = Standalone(base, authorization)
    try:
        server.start()
        yield server
    finally:
        server.stop()
