"""The demo's pipeline: media, evaluation records, models, results and index, each built once.

Every step writes under the data directory and is skipped when its output is already there, so
the first `hclip demo` builds everything and later starts go straight to serving. `build.json`
records what built the directory (the media, the recipe, the seed); a directory built by
anything else is rebuilt rather than mixed with it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from app.demo.data import DATASETS, build_media, make_records, media_spec, write_jsonl
from app.demo.recipe import HEADS, Recipe
from app.demo.report import markdown, plot
from app.demo.runner import run_heads
from indexer.build.build_job import build
from indexer.build.options import JobOptions
from indexer.store import artifact

log = logging.getLogger(__name__)

N_GALLERY, N_QUERIES = 500, 400
STAMP = "build.json"
# What the demo derives from its media at the top of its directory: only these are ever
# removed (the media themselves are app/demo/data.py's to redo).
DERIVED: tuple[str, ...] = (*DATASETS, "examples.json", "results.json", "results.md")
DERIVED += ("results.png",)


def stamp(recipe: Recipe, seed: int) -> dict[str, Any]:
    return {"media": media_spec(), "recipe": recipe.to_dict(), "seed": seed}


def ensure_fresh(data: Path, recipe: Recipe, seed: int) -> None:
    """Clear what other media, another recipe or another seed built here, then record ours."""
    data.mkdir(parents=True, exist_ok=True)
    path = data / STAMP
    want = stamp(recipe, seed)
    if path.exists() and json.loads(path.read_text()) == want:
        return
    stale = [data / name for name in DERIVED if (data / name).exists()]
    if stale:
        log.warning("%s was built by another recipe, seed or media: rebuilding it", data)
        for target in stale:
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(want, indent=2) + "\n")
    os.replace(tmp, path)


def prepare_records(data: Path) -> None:
    """Each dataset's held-out queries and gallery (training tuples are drawn in memory)."""
    media = build_media(data)
    for i, dataset in enumerate(DATASETS):
        d = data / dataset
        d.mkdir(exist_ok=True)
        if not (d / "gallery.jsonl").exists():
            write_jsonl(
                d / "queries.jsonl",
                make_records(dataset, media, "held_out", N_QUERIES, 20 + i, "q"),
            )
            write_jsonl(
                d / "gallery.jsonl",
                make_records(dataset, media, "held_out", N_GALLERY, 30 + i, dataset[0]),
            )


def run_all(data: Path, recipe: Recipe, seed: int, progress: bool) -> dict[str, Any]:
    """Train and evaluate both heads on both datasets; results under data/results.*"""
    ensure_fresh(data, recipe, seed)
    prepare_records(data)
    results_path = data / "results.json"
    if results_path.exists():
        return dict(json.loads(results_path.read_text()))
    by_dataset, seconds = run_heads(data, recipe, HEADS, seed, progress)
    results: dict[str, Any] = {
        "seed": seed,
        "recipe": recipe.to_dict(),
        "datasets": {d: by_dataset[d] for d in DATASETS},
        "seconds": seconds,
    }
    (data / "results.md").write_text(markdown(results))
    plot(results["datasets"], data / "results.png")
    tmp = results_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, results_path)  # last: its presence says that everything above is done
    return results


def ensure_index(data: Path, dataset: str) -> Path:
    """The served index: the H-CLIP model over the dataset's held-out gallery."""
    root = data / dataset / "index"
    if artifact.read_current(root) is None:
        build(
            data / dataset / "model-hclip",
            data / dataset / "gallery.jsonl",
            root,
            JobOptions(progress=False, media_root=data),  # the records name "../images/..."
        )
    return root
