"""`hclip index tune`: re-tune the published version's views and publish the result as a new
version, re-using the stored embeddings (nothing is re-encoded).

    hclip index tune --root ROOT [--view V[,V..]] [--recall R] [--queries FILE]
                     [--min-speedup X] [--families hnsw,ivf,ivfip,ivfpq,ivfsq]
                     [--timing-seconds S] [--model MODEL_DIR] [--plot DIR]

The new version is the current one with the tuned views rebuilt (indexer.build.views.build_view
with an `auto` spec, so the tuner of indexer.tune picks each one's index) and every other file
hard-linked from the current version (files of a published version are never modified, so a
link is as good as a copy; a copy is made where links are not possible). It is staged, fully
verified and published like a build (indexer.store.artifact), under the root's writer lock.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from indexer.build.views import build_view
from indexer.search.specs import IndexSpec, SpecError
from indexer.store import artifact
from indexer.store.recordstore import id_hash_of
from indexer.store.rows import load_rows
from indexer.store.verify import verify_contents
from indexer.store.version import LoadedVersion, built_by, is_compact
from indexer.tune.query_log import read_queries
from indexer.tune.tuner import FAMILIES, TuneOptions
from models.checkpoint import load_model
from models.model import MultimodalModel

log = logging.getLogger(__name__)

VIEW_FILES = (".faiss", ".npy", ".rows.npy")  # a view's files, all rebuilt when it is tuned


def run(args: argparse.Namespace) -> int:
    target = IndexSpec.parse(f"auto:recall={args.recall}").target_recall
    assert target is not None
    families = tuple(f.strip() for f in (args.families or ",".join(FAMILIES)).split(","))
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise SpecError(f"--families: unknown family {bad[0]!r} (known: {', '.join(FAMILIES)})")
    if args.min_speedup < 0 or args.timing_seconds <= 0 or args.served_batch < 1:
        raise SpecError(
            "--min-speedup must not be negative, --timing-seconds and --served-batch positive"
        )
    views = [v.strip() for v in args.view.split(",")] if args.view else None
    opts = TuneOptions(
        families=families,
        min_speedup=args.min_speedup,
        timing_s=args.timing_seconds,
        served_batch=args.served_batch,
    )
    _, manifest = tune_version(args.root, target, opts, views, args.queries, args.model)
    print(f"published version {manifest['version']} (tuned from {manifest['parent']})")
    for name in manifest["tune"]["views"]:
        entry = manifest["views"][name]
        t = entry.get("tuning", {})
        check = t.get("check", {})
        speed = (
            f", {check['speedup_batch']}x flat's queries/s in batches of {t['served_batch']}, "
            f"{check['speedup_single']}x alone"
            if "speedup_batch" in check
            else ""
        )
        why = f" ({t['why']})" if "why" in t else ""
        print(
            f"  view {name:<20} {IndexSpec.from_dict(entry['spec'])}  recall@10 "
            f"{entry['recall_at_10']}{speed}{why}"
        )
    if args.plot:
        from indexer.tune.frontier_plot import plot_view

        args.plot.mkdir(parents=True, exist_ok=True)
        for name in manifest["tune"]["views"]:
            if "frontier" in manifest["views"][name].get("tuning", {}):
                out = args.plot / f"{name}.png"
                plot_view(manifest["views"][name]["tuning"], f"view {name}", out)
                print(f"  frontier of view {name}: {out}")
    return 0


def _model(manifest: dict[str, Any], model_dir: Path | None) -> MultimodalModel:
    """The model that built the version: the query side of the tuning (omega) needs its
    weights, and a different model would tune for queries the version never gets."""
    return load_model(built_by(manifest, model_dir))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _check(stage: Path) -> list[str]:
    LoadedVersion(stage).records.close()  # opening checks every shape against the manifest
    return verify_contents(stage)


def tune_version(
    root: Path,
    target: float,
    opts: TuneOptions,
    views: list[str] | None = None,
    queries: Path | None = None,
    model_dir: Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Publish a new version whose `views` (default: all) are tuned for recall@10 >= target;
    (its path, its manifest)."""
    with artifact.root_lock(root, "tune"):
        artifact.clean_staging(root)
        old = artifact.current_version_dir(root)
        manifest = artifact.read_manifest(old)
        if (manifest.get("backend") or {}).get("kind") == "milvus":
            raise SpecError(
                f"version {old.name} keeps its views in Milvus: `hclip index tune` measures FAISS "
                "indexes on this machine; give Milvus an index with `hclip index update --root "
                f"{root} --spec hnsw|ivf|ivfpq|ivfsq[:...]` (its recall@10 is measured)"
            )
        if is_compact(manifest):
            raise SpecError(
                f"version {old.name} is compact: `hclip index tune` measures indexes over float32 "
                "views, which a compact version does not keep; its codes are set by --spec at "
                f"`hclip index update --root {root} --compact --spec sq8|ivfsq|ivfpq[:...]`"
            )
        known = list(manifest["views"])
        chosen = views or known
        unknown = [v for v in chosen if v not in known]
        if unknown:
            raise SpecError(f"--view: no view {unknown[0]!r} in {old.name} (views: {known})")
        model = _model(manifest, model_dir)
        if queries is not None:
            opts.held_out, other = read_queries(queries, model, chosen)
            log.info(
                "held-out queries: %s; %d lines for other views ignored",
                {v: len(q) for v, q in opts.held_out.items()},
                other,
            )
        stage = artifact.staging_dir(root, artifact.new_version_id())
        with artifact.removed_on_failure(root, stage):
            rebuilt = {f"{artifact.VIEWS}/{v}{ext}" for v in chosen for ext in VIEW_FILES}
            for rel in manifest["files"]:
                if rel not in rebuilt:
                    _link_or_copy(old / rel, stage / rel)
            stored = load_rows(stage, manifest["modalities"], mmap=False)
            entries = dict(manifest["views"])
            spec = IndexSpec("auto", {}, target)
            for name in chosen:
                query = tuple(entries[name]["query"])
                entries[name] = build_view(stage, model.head, stored, query, spec, opts)
            new = {k: v for k, v in manifest.items() if k not in ("files", "update", "tune")}
            new |= {
                "format_version": artifact.FORMAT_VERSION,
                "id_hash": id_hash_of(manifest),  # the store is kept as it is
                "version": stage.name,
                "parent": old.name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "views": entries,
                "tune": {
                    "views": chosen,
                    "target_recall": target,
                    "queries_file": str(queries.resolve()) if queries else None,
                    "families": list(opts.families),
                    "min_speedup": opts.min_speedup,
                },
            }
            path = artifact.publish(root, stage, new, _check)
    log.info("published version %s (views tuned: %s)", stage.name, ", ".join(chosen))
    return path, new
