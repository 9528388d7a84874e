"""`hclip serve --root ROOT [--host H] [--port P]`: the service under uvicorn."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.settings import Settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, help="index root (default: $HCLIP_ROOT)")
    p.add_argument("--host", help="default: $HCLIP_HOST or 127.0.0.1")
    p.add_argument("--port", type=int, help="default: $HCLIP_PORT or 8000")


def serve(settings: Settings) -> None:
    import uvicorn

    from app.main import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
    )


def run(args: argparse.Namespace) -> int:
    overrides = {
        k: v
        for k, v in (("root", args.root), ("host", args.host), ("port", args.port))
        if v is not None
    }
    serve(Settings(**overrides))
    return 0
