"""The end of every job: from a staged version whose rows are written (a PublishPlan), its
views, its manifest, the full check and the atomic publication; on the milvus backend, its
collections first."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from indexer.build import compact, milvus_export
from indexer.build.backend import Target
from indexer.build.engine import engine_block
from indexer.build.options import JobOptions, JobResult
from indexer.build.views import FlatViewsWriter, build_view
from indexer.ingest.validate import Rejected
from indexer.store import artifact, milvus
from indexer.store.recordstore import ID_HASH_KIND
from indexer.store.rows import StoredRows, load_rows
from indexer.store.verify import verify_contents
from indexer.store.version import LoadedVersion
from models.heads import default_views
from models.model import MultimodalModel
from models.records import RecordError

log = logging.getLogger(__name__)

MANIFEST_REJECTS = 100  # inline in the manifest; rejected.jsonl lists every one


@dataclass(frozen=True)
class PublishPlan:
    """What a job publishes: the staged version under `root` (its rows written), the version it
    follows, the model that encoded it, what was rejected, and where it is served from."""

    root: Path
    stage: Path  # the staged version: its name is the version's
    parent: str | None  # the version published before it, if any
    model: MultimodalModel
    model_block: dict[str, Any]  # the manifest's "model"
    opts: JobOptions
    rejected: tuple[Rejected, ...]
    fields: dict[str, dict[str, Any]]  # the filter fields' columns (RecordStoreWriter)
    extra: dict[str, Any]  # the job's own manifest entries ("source", "update")
    timings: dict[str, float]  # the job's phases so far
    written: FlatViewsWriter | None  # views written with the rows (views_writer), to finish
    target: Target = None  # the milvus backend's target and spec; None: local FAISS files


def views_writer(stage: Path, model: MultimodalModel, opts: JobOptions) -> FlatViewsWriter | None:
    """Exact views are written with the rows (indexer.build.views.FlatViewsWriter); the others are
    built from the stored embeddings once every row is in (publish)."""
    if not opts.spec.exact or opts.spec.tuned or opts.compact:
        return None
    return FlatViewsWriter(stage, model.head, opts.views or default_views(model.names), opts.spec)


def publish(plan: PublishPlan) -> JobResult:
    """Build every view from the staged embeddings (or finish those written with the rows),
    write the manifest, check and publish; on the milvus backend (`plan.target`), write the
    collections first: CURRENT names the version only once every one is loaded."""
    stage, model, target = plan.stage, plan.model, plan.target
    if plan.opts.compact:
        if target is not None:  # compact.check_options refuses it first: never half-written
            raise artifact.ArtifactError("--compact: not supported with --backend milvus")
        compact.halve_embeddings(stage, model.names)
    stored = load_rows(stage, model.names, mmap=False)
    if stored.count == 0:
        raise RecordError("no valid records: nothing to index")
    timings = dict(plan.timings)
    start = time.perf_counter()
    entries = plan.written.finish() if plan.written else _build_views(plan, stored)
    views = {"+".join(entry["query"]): entry for entry in entries}
    timings["views_s"] = time.perf_counter() - start
    _write_rejects(stage, plan.rejected)
    manifest = _manifest(plan, stored, views)

    def check(staged: Path) -> list[str]:
        t = time.perf_counter()
        problems = _full_check(staged)
        timings["check_s"] = time.perf_counter() - t
        return problems

    if target is not None:
        start = time.perf_counter()
        milvus_target, milvus_spec = target
        manifest["backend"] = milvus_export.export(
            stage, manifest, milvus_target, milvus_spec, model.head, stored
        )
        timings["milvus_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        path = artifact.publish(plan.root, stage, manifest, check if plan.opts.check else None)
    except BaseException:
        if target is not None:
            try:
                milvus.drop_version(manifest["backend"])
            except Exception as exc:  # the next job's clean-up drops them
                log.warning("collections of the unpublished version not dropped: %s", exc)
        raise
    timings["publish_s"] = time.perf_counter() - start  # checksums, the check, fsync, rename
    if target is not None:
        milvus.point_aliases(manifest)
    log.info("published version %s (%d records, %d views)", stage.name, stored.count, len(views))
    log.info("timings: %s", ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    return JobResult(stage.name, path, manifest, list(plan.rejected), timings)


def _build_views(plan: PublishPlan, stored: StoredRows) -> list[dict[str, Any]]:
    """Every approximate or tuned view's manifest entry, in order, built one by one from the
    stored embeddings: FAISS spreads one build over the cores itself, and a tuner's timings
    must not share the machine with another view."""
    model, opts = plan.model, plan.opts
    queries = opts.views or default_views(model.names)
    if opts.compact:
        return compact.build_views(plan.stage, model.head, stored, queries, opts.spec)
    return [build_view(plan.stage, model.head, stored, q, opts.spec) for q in queries]


def _write_rejects(stage: Path, rejected: tuple[Rejected, ...]) -> None:
    if rejected:
        with open(stage / artifact.REJECTED, "wb") as f:
            for r in rejected:
                f.write(orjson.dumps(r.to_dict()) + b"\n")


def _manifest(
    plan: PublishPlan, stored: StoredRows, views: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    model, rejected = plan.model, plan.rejected
    return {
        "format_version": artifact.FORMAT_VERSION,
        "version": plan.stage.name,
        "parent": plan.parent,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": plan.model_block,
        "modalities": model.names,
        "d": model.cfg.latent_dim,
        "id_hash": ID_HASH_KIND,  # indexer.store.recordstore: the store's id hash
        "counts": {
            "records": stored.count,
            "by_modality": {n: int(stored.present(n).sum()) for n in model.names},
            "rejected": len(rejected),
        },
        "views": views,
        "filter_fields": plan.fields,
        "rejected": [r.to_dict() for r in rejected[:MANIFEST_REJECTS]],
        "rejected_file": artifact.REJECTED if rejected else None,
        "engine": engine_block(plan.opts),
        **({"compact": compact.manifest_block(plan.opts.spec)} if plan.opts.compact else {}),
        **plan.extra,
    }


def _full_check(stage: Path) -> list[str]:
    LoadedVersion(stage).records.close()  # opening checks every shape against the manifest
    return verify_contents(stage)
