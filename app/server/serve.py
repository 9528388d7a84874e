"""`hclip serve --root ROOT [--host H] [--port P] [--workers N]`: the service under uvicorn.

With --workers N, N worker processes serve one port, each on a listening socket of its own
(app/supervisor.py says why); each opens the published version itself (memory-mapped: the
pages are shared through the page cache, not copied), with its own batchers and its own poller,
so each swaps versions by itself. Settings reach the workers through the environment, as HCLIP_*
variables.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.core.settings import Settings
from app.server import supervisor

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        type=Path,
        help="the index root to serve (default: $HCLIP_ROOT, else data/index under the "
        "current directory)",
    )
    p.add_argument("--host", help="address to listen on (default: $HCLIP_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: $HCLIP_PORT or 8000)")
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes, each a copy of the service on the same port (default: "
        "$HCLIP_WORKERS, else one per core)",
    )


def serve(settings: Settings, on_listening: Callable[[], None] | None = None) -> None:
    """Serve until stopped. `on_listening` (one process only) is called once the server
    listens, its version loaded: when a user can open the page."""
    import uvicorn

    if settings.workers == 1:
        from app.main import create_app

        supervisor.reserve(settings.host, settings.port).close()  # a taken port: PortInUse now

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                if on_listening is not None and self.started:
                    on_listening()

        config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level="info",
            access_log=False,
        )
        Server(config).run()
        return
    # Workers read their settings from the environment, forked or spawned.
    os.environ.update(settings.as_environment())
    metrics_dir = Path(tempfile.mkdtemp(prefix="hclip-metrics-"))
    # Before anything imports prometheus_client, which reads it then (app.core.metrics): the
    # workers are forked from this process once it has imported the app.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    log.info("%d workers; PROMETHEUS_MULTIPROC_DIR=%s", settings.workers, metrics_dir)
    try:
        supervisor.run(settings.host, settings.port, settings.workers, worker_gone)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def worker_gone(pid: int) -> None:
    """A worker process ended: its live gauges leave /metrics (its counters stay summed)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def run(args: argparse.Namespace) -> int:
    given = {"root": args.root, "host": args.host, "port": args.port, "workers": args.workers}
    settings = Settings(**{k: v for k, v in given.items() if v is not None})
    root = settings.root.resolve()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        print(
            f"hclip serve: error: the index root {root} {what} (--root, HCLIP_ROOT; default: "
            f"data/index under the current directory); build one with `hclip index build "
            f"--model MODEL_DIR --records RECORDS --root {root}`",
            file=sys.stderr,
        )
        return 2
    try:
        serve(settings)
    except supervisor.PortInUse as exc:
        print(f"hclip serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
