"""`hclip serve --root ROOT [--host H] [--port P] [--workers N]`: the service under uvicorn.

With --workers N, uvicorn's own process manager runs N worker processes, each listening on a
socket of its own for the address (app.server.worker_sockets says why), and starts a new one
when a worker dies. Each worker opens the published version itself
(memory-mapped: the pages are shared through the page cache, not copied), with its own batchers
and its own poller, so each swaps versions by itself; each accepts connections only once its
version is loaded and warmed (uvicorn listens after the app's start-up), and /readyz answers 200
once every worker serves (app.services.workers). Settings reach the workers through the
environment, as HCLIP_* variables; /metrics adds up every worker's figures
(PROMETHEUS_MULTIPROC_DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.core.logs import dict_config
from app.core.settings import Settings

log = logging.getLogger(__name__)
# uvicorn restarts a worker that does not answer its health check in this time: a worker
# checking a large version's files holds its interpreter busy for a while.
HEALTHCHECK_S = 60


class PortInUse(OSError):
    pass


class CannotServe(ValueError):
    """A setting the workers could not serve with, found before any starts."""


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


def check_port(host: str, port: int) -> None:
    """PortInUse now, before anything is loaded, when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUse(f"cannot bind {host}:{port}: {exc.strerror}") from None


def milvus_lite_path(settings: Settings) -> str | None:
    """The Milvus Lite path the workers would open, if any: HCLIP_MILVUS_URI, else the published
    version's or the root's backend (indexer.store.milvus)."""
    from indexer.store import artifact, milvus

    uris = [settings.milvus_uri] if settings.milvus_uri else []
    if not uris:
        root = settings.root
        with contextlib.suppress(artifact.ArtifactError):  # the workers report a broken root
            vid = artifact.published(root)
            manifest = artifact.read_manifest(artifact.version_dir(root, vid)) if vid else {}
            block = manifest.get("backend") or {}
            if block.get("kind") == "milvus":
                uris.append(str(block["uri"]))
            config = milvus.read_root(root) or {}
            if config.get("kind") == "milvus" and config.get("uri"):
                uris.append(str(config["uri"]))
    return next((u for u in uris if milvus.is_lite(u)), None)


def check_workers(settings: Settings) -> None:
    """CannotServe now when the workers would share what only one process can open."""
    lite = milvus_lite_path(settings) if settings.workers > 1 else None
    if lite is not None:
        raise CannotServe(
            f"the views are in Milvus Lite at {lite}, which one process at a time can open, "
            f"and {settings.workers} workers would each open it: serve with --workers 1, or "
            "run a Milvus server on it and give its URI (HCLIP_MILVUS_URI=http://HOST:19530)"
        )


def serve(settings: Settings, on_listening: Callable[[], None] | None = None) -> None:
    """Serve until stopped. `on_listening` (one process only) is called once the server
    listens, its version loaded: when a user can open the page."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from app.api.auth import Keys
    from app.server.worker_sockets import SPREADS, ReservedSocket
    from models.extras import require_onnx

    Keys.of(settings)  # keys that cannot be had stop the start here, not in every worker
    if settings.encoder_runtime != "torch":  # so does a runtime that is not installed
        require_onnx(f"HCLIP_ENCODER_RUNTIME={settings.encoder_runtime}")
    check_port(settings.host, settings.port)
    check_workers(settings)
    if settings.workers == 1:
        from app.main import create_app

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                if on_listening is not None and self.started:
                    on_listening()

        config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_config=dict_config(),
            access_log=False,
        )
        Server(config).run()
        return
    metrics_dir = Path(tempfile.mkdtemp(prefix="hclip-metrics-"))
    workers_dir = Path(tempfile.mkdtemp(prefix="hclip-workers-"))
    # Workers are fresh interpreters: their settings come from the environment.
    os.environ.update(settings.as_environment())
    os.environ["HCLIP_WORKERS_DIR"] = str(workers_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    log.info("%d workers; PROMETHEUS_MULTIPROC_DIR=%s", settings.workers, metrics_dir)
    config = uvicorn.Config(
        "app.main:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        log_config=dict_config(),
        access_log=False,
        timeout_worker_healthcheck=HEALTHCHECK_S,
    )
    # uvicorn.run's own steps for workers, with a socket of each worker's own where the kernel
    # spreads connections over them (app/server/worker_sockets.py says why)
    sock = ReservedSocket.bind_to(settings.host, settings.port) if SPREADS else config.bind_socket()
    try:
        Multiprocess(config, sockets=[sock]).run()
    except KeyboardInterrupt:  # as uvicorn.run: Ctrl-C stops the workers, then returns
        pass
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(workers_dir, ignore_errors=True)


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
    except (PortInUse, CannotServe) as exc:
        print(f"hclip serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
