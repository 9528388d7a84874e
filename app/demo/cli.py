"""`hclip demo [--port P]`: build (or reuse) the digits dataset, models and index, then serve
the API with an in-process cache and the search page at `/`."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from app.demo.data import (
    DATASETS,
    HELD_OUT_VOICES,
    TRAIN_VOICES,
    WORDS,
    DemoError,
    build_media,
)
from app.demo.recipe import Recipe

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port", type=int, default=8000, help="port the page and the API listen on (default 8000)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(".hclip-demo"),
        help="where the dataset, models and index are built and reused (default: .hclip-demo "
        "under the current directory)",
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


def voice_of(clip: str, word: str) -> str:
    """The espeak-ng voice a clip was spoken in, from its name (audio/<word>_<voice>_<speed>_
    <pitch>.wav, the voice's '+' written '_')."""
    written = Path(clip).stem.removeprefix(f"{word}_").rsplit("_", 2)[0]
    voices = {v.replace("+", "_"): v for v in (*TRAIN_VOICES, *HELD_OUT_VOICES)}
    return voices.get(written, written)


TASKS = {
    "interaction": "Each record pairs an image of a digit a, a spoken digit b and the text of "
    "(a + b) mod 10: query with any one or two of them, and the rest are retrieved.",
    "shared": "Each record shows one digit three ways (an image, spoken, written): query with "
    "any one or two of them, and the rest are retrieved.",
}


def write_examples(data: Path, dataset: str) -> None:
    """Held-out media for the page's pickers (never seen in training), and the task the served
    records hold, which the page states and checks each result against."""
    media = build_media(data)
    examples = {
        "task": {"dataset": dataset, "line": TASKS[dataset]},
        "image": [
            {"url": f"/media/{media.images['held_out'][d][j]}", "label": str(d)}
            for j in range(2)
            for d in range(10)
        ],
        "audio": [
            {"url": f"/media/{clip}", "label": WORDS[d], "voice": voice_of(clip, WORDS[d])}
            for j in range(2)
            for d in range(10)
            for clip in [media.clips["held_out"][d][j * 13]]
        ],
        "text": [media.texts["held_out"][d][0] for d in range(10)],
    }
    (data / "examples.json").write_text(json.dumps(examples))


def run(args: argparse.Namespace) -> int:
    from app.demo.pipeline import ensure_index, run_all  # torch: not for the help
    from app.demo.runner import quiet_model_loading
    from app.server.serve import PortInUse, check_port, serve

    if not args.no_serve:  # a taken port is said now, not after minutes of building
        try:
            check_port(args.host, args.port)
        except PortInUse as exc:
            raise DemoError(f"{exc}: pass another --port") from None
    quiet_model_loading()
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(data, Recipe(), args.seed, progress=not args.quiet)
    write_examples(data, args.dataset)
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

    page = f"http://{args.host}:{args.port}/"
    settings = Settings(root=root, media_dir=data, host=args.host, port=args.port, workers=1)
    try:
        serve(settings, on_listening=lambda: print(f"search page: {page}", flush=True))
    except PortInUse as exc:
        raise DemoError(f"{exc}: pass another --port") from None
    return 0
