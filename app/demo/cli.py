"""`hclip demo [--port P]`: build (or reuse) the digits dataset, models and index, then serve
the API with an in-process cache and the search page at `/`."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from app.demo.data import DATASETS, WORDS, build_media
from app.demo.pipeline import ensure_index, run_all
from app.demo.recipe import Recipe
from app.demo.runner import quiet_model_loading

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(".hclip-demo"),
        help="where the dataset, models and index are built and reused",
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="interaction",
        help="which dataset the page searches (both are trained and evaluated)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="training seed: with the same thread count, the same seed gives the same models",
    )
    p.add_argument("--no-serve", action="store_true", help="build everything, then exit")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def write_examples(data: Path) -> None:
    """Held-out media for the page's pickers: never seen in training."""
    media = build_media(data)
    examples = {
        "image": [
            {"url": f"/media/{media.images['held_out'][d][j]}", "label": str(d)}
            for j in range(2)
            for d in range(10)
        ],
        "audio": [
            {"url": f"/media/{media.clips['held_out'][d][j * 13]}", "label": WORDS[d]}
            for j in range(2)
            for d in range(10)
        ],
        "text": [media.texts["held_out"][d][0] for d in range(10)],
    }
    (data / "examples.json").write_text(json.dumps(examples))


def run(args: argparse.Namespace) -> int:
    quiet_model_loading()
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(data, Recipe(), args.seed, progress=not args.quiet)
    write_examples(data)
    root = ensure_index(data, args.dataset)
    log.info(
        "dataset, models and index ready in %.0f s (results in %s)",
        time.perf_counter() - t0,
        data / "results.md",
    )
    print((data / "results.md").read_text())
    if args.no_serve:
        return 0 if results else 1
    from app.core.settings import Settings
    from app.server.serve import serve

    print(f"search page: http://{args.host}:{args.port}/")
    serve(Settings(root=root, media_dir=data, host=args.host, port=args.port))
    return 0
