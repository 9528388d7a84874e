"""`hclip serve --workers N`: N uvicorn processes, each listening on a socket of its own bound
to the same address (SO_REUSEPORT), so that the kernel spreads new connections over them by a
hash of their addresses; and a parent that restarts a worker that dies.

Why not uvicorn's own workers: they share one listening socket, and the worker that wakes first
takes every connection waiting (asyncio accepts up to its backlog in one go). Measured with wrk
opening 32 connections to 2 workers: 24 went to one worker and 8 to the other in six runs of
six, so that one worker's core ran flat out while the other waited. Connections that stay open
(wrk's, a load balancer's keep-alive pool) stay where they landed, so the imbalance lasts.

SO_REUSEPORT spreads connections this way on Linux (the containers' system); other systems may
accept the option without spreading them, and there the workers would serve unevenly.

The parent keeps a bound socket of its own that never listens: it holds the port between worker
restarts (connections go only to listening sockets) and gives every worker the same port when
the one asked for is 0.

A worker listens only once its app has started, that is once it has loaded and warmed the
version it serves (app.main's lifespan; uvicorn listens after it), so a connection the kernel
gives a worker is one it can answer; a restarted worker rejoins the same way.

Where fork exists, the parent imports the app once and forks the workers, so that start-up does
not grow with their number: each worker skips the imports (torch's above all) and only loads
its version. The parent runs nothing of the app (no thread, no torch operation), so a fork
copies nothing half-done. Elsewhere the workers are spawned, fresh interpreters.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

RESTART_FIRST_S = 0.5  # a dead worker is restarted after this, doubling while it keeps dying
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # a worker that lived this long resets the backoff
STOP_GRACE_S = 30.0  # SIGTERM lets requests finish; past this a worker is killed
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PortInUse(OSError):
    pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUse(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


def reserve(host: str, port: int) -> socket.socket:
    """The parent's socket: bound with SO_REUSEPORT, never listening. Refused when anything
    already listens there, including another server of this user's with SO_REUSEPORT, which
    the bind alone would let share the port."""
    if port:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((host, port)) == 0:
                raise PortInUse(f"cannot bind {host}:{port}: something already listens there")
    return reuseport_socket(host, port)


def exit_with(parent: int) -> None:
    """Have the kernel send this process SIGTERM when `parent` dies, however it dies (SIGKILL,
    the OOM killer): an orphaned worker would go on serving the port with no supervisor.
    Linux's prctl(PR_SET_PDEATHSIG); elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def serve_one(host: str, port: int, parent: int, load: Any, slot: int, held: int) -> None:
    """A worker process: its own listening socket, the app from HCLIP_* variables, its
    searches counted in slot `slot` of the workers' shared `load` (app.services.idle_cores).
    `held` is the parent's reserved socket, which a forked worker closes (-1: spawned)."""
    import uvicorn

    from app.core.logs import configure_logging
    from app.services import idle_cores

    for sig in (signal.SIGTERM, signal.SIGINT):  # a forked worker has the parent's handlers
        signal.signal(sig, signal.SIG_DFL)
    if held >= 0:
        os.close(held)
    exit_with(parent)
    idle_cores.attach(load, slot)
    # A spawned worker is a fresh interpreter: without this it would log none of the app's
    # own lines (version loads and rejections).
    configure_logging()
    sock = reuseport_socket(host, port)
    config = uvicorn.Config(
        "app.main:create_app",
        factory=True,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class Worker:
    slot: int
    process: BaseProcess
    started: float
    backoff_s: float = RESTART_FIRST_S
    restart_at: float | None = None  # set while dead and waiting for its restart


def run(host: str, port: int, workers: int, on_exit: Callable[[int], None]) -> None:
    """Serve until SIGTERM or SIGINT, then stop every worker.
    `on_exit(pid)` is called for each worker process that has ended (its metrics are dropped).
    Workers read their settings from the environment (HCLIP_* variables)."""
    held = reserve(host, port)
    port = held.getsockname()[1]
    forked = "fork" in multiprocessing.get_all_start_methods()
    if forked:
        import app.main  # noqa: F401 - imported once here, inherited by every forked worker
    ctx = multiprocessing.get_context("fork") if forked else multiprocessing.get_context("spawn")
    stopping = threading.Event()
    from app.services.idle_cores import make_shared

    load = make_shared(workers)

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def start(slot: int) -> BaseProcess:
        process = ctx.Process(
            target=serve_one,
            args=(host, port, os.getpid(), load, slot, held.fileno() if forked else -1),
            name=f"hclip-worker-{slot}",
        )
        process.start()
        log.info("worker %d started (pid %s)", slot, process.pid)
        return process

    pool = [Worker(slot, start(slot), time.monotonic()) for slot in range(workers)]
    log.info("%d workers on %s:%d, a listening socket each (SO_REUSEPORT)", workers, host, port)
    try:
        while not stopping.wait(0.2):
            now = time.monotonic()
            for w in pool:
                if w.restart_at is None and not w.process.is_alive():
                    w.process.join()
                    if w.process.pid is not None:
                        on_exit(w.process.pid)
                    if now - w.started >= STABLE_S:
                        w.backoff_s = RESTART_FIRST_S
                    w.restart_at = now + w.backoff_s
                    log.error(
                        "worker %d (pid %s) exited with code %s; restarting it in %.1f s",
                        w.slot, w.process.pid, w.process.exitcode, w.backoff_s,
                    )  # fmt: skip
                    w.backoff_s = min(RESTART_MAX_S, w.backoff_s * 2)
                elif w.restart_at is not None and now >= w.restart_at:
                    w.process, w.started, w.restart_at = start(w.slot), now, None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_all([w.process for w in pool if w.restart_at is None], on_exit)
        held.close()


def _stop_all(processes: list[BaseProcess], on_exit: Callable[[int], None]) -> None:
    """SIGTERM (uvicorn then finishes the requests in flight), SIGKILL past the grace."""
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.error("worker pid %s did not stop in %.0f s: killed", process.pid, STOP_GRACE_S)
            process.kill()
            process.join()
        if process.pid is not None:
            on_exit(process.pid)
