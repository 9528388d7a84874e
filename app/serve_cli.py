"""`hclip serve --root ROOT [--host H] [--port P]`: the service under uvicorn."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, help="index root (default: $HCLIP_ROOT)")
    p.add_argument("--host", help="default: $HCLIP_HOST or 127.0.0.1")
    p.add_argument("--port", type=int, help="default: $HCLIP_PORT or 8000")


def run(args: argparse.Namespace) -> int:
    # Idle OpenMP threads must sleep, not spin, while the other core serves HTTP; this has to
    # be set before the OpenMP runtime starts.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn

    from app.main import create_app
    from app.settings import Settings

    overrides = {
        k: v
        for k, v in (("root", args.root), ("host", args.host), ("port", args.port))
        if v is not None
    }
    settings = Settings(**overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
    )
    return 0
