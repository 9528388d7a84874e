"""`index build` and `index update`: stage a complete version, then publish it atomically."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from indexer import artifact
from indexer.arrays import NpyRows
from indexer.encode import RowWriter, Validator, encode_records
from indexer.reader import iter_stored_records, load_rows
from indexer.sources import iter_records
from indexer.specs import IndexSpec
from indexer.views import build_view
from models.checkpoint import fingerprint, load_model, read_config
from models.heads import default_views
from models.model import MultimodalModel
from models.records import RecordError

log = logging.getLogger(__name__)


@dataclass
class JobOptions:
    spec: IndexSpec = field(default_factory=lambda: IndexSpec("flat"))
    views: list[tuple[str, ...]] | None = None  # None: DESIGN §4's default set
    batch_size: int = 256
    skip_bad: bool = False
    progress: bool = True


@dataclass
class JobResult:
    version: str
    path: Path
    manifest: dict[str, Any]

    @property
    def rejected(self) -> list[dict[str, Any]]:
        return list(self.manifest.get("rejected", []))


def _model_block(model_dir: Path, fp: str) -> dict[str, Any]:
    _, raw = read_config(model_dir)
    return {
        "path": str(model_dir.resolve()),
        "fingerprint": fp,
        "config": {k: raw[k] for k in ("modalities", "head", "latent_dim")},
    }


def _finish(
    root: Path,
    stage: Path,
    model: MultimodalModel,
    model_block: dict[str, Any],
    opts: JobOptions,
    validator: Validator,
    parent: str | None,
    extra: dict[str, Any],
) -> JobResult:
    """Build every view from the staged embeddings, write the manifest and publish."""
    stored = load_rows(stage, model.names, mmap=False)
    if stored.count == 0:
        raise RecordError("no valid records: nothing to index")
    views = {}
    for q in opts.views or default_views(model.names):
        entry = build_view(stage, model.head, stored, q, opts.spec)
        views["+".join(entry["query"])] = entry
    count = stored.count
    manifest = {
        "format_version": artifact.FORMAT_VERSION,
        "version": stage.name,
        "parent": parent,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_block,
        "modalities": model.names,
        "d": model.cfg.latent_dim,
        "counts": {
            "records": stored.count,
            "by_modality": {n: int(stored.present[n].sum()) for n in model.names},
            "rejected": len(validator.rejected),
        },
        "views": views,
        "rejected": [r.to_dict() for r in validator.rejected[:1000]],
        **extra,
    }
    path = artifact.publish(root, stage, manifest)
    log.info("published version %s (%d records, %d views)", stage.name, count, len(views))
    return JobResult(stage.name, path, manifest)


def build(model_dir: Path, records_path: Path, root: Path, opts: JobOptions) -> JobResult:
    model = load_model(model_dir)
    block = _model_block(model_dir, fingerprint(model_dir))
    with artifact.root_lock(root):
        artifact.clean_staging(root)
        stage = artifact.staging_dir(root, artifact.new_version_id())
        try:
            writer = RowWriter(stage, model.names, model.cfg.latent_dim)
            validator = Validator(model, records_path.parent, skip_bad=opts.skip_bad)
            try:
                encode_records(
                    model,
                    iter_records(records_path),
                    validator,
                    writer,
                    opts.batch_size,
                    opts.progress,
                )
            finally:
                writer.close()
            extra = {"source": {"records": str(records_path.resolve())}}
            return _finish(
                root, stage, model, block, opts, validator, artifact.read_current(root), extra
            )
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _read_ids(path: Path) -> list[str]:
    try:
        text = path.read_text()  # a pipe (`<(...)`) is fine too, so no is_file() check
    except FileNotFoundError:
        raise RecordError(f"ids file not found: {path}") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _upsert_ids(path: Path) -> set[str]:
    """First pass over the upserts: their ids only, so old rows can be dropped while copying."""
    return {obj["id"] for _, obj in iter_records(path) if isinstance(obj.get("id"), str)}


def _copy_rows(old: Path, writer: RowWriter, drop: set[str]) -> tuple[int, set[str]]:
    """Stream the old version's rows whose ids are not in `drop` into the new version, with
    their stored embeddings; returns the number of rows kept and every old id."""
    arrays = {n: NpyRows(old / artifact.EMBEDDINGS / f"{n}.npy") for n in writer.names}
    kept, seen = 0, set()
    rows: list[int] = []
    recs: list[dict[str, Any]] = []

    def flush() -> None:
        idx = np.array(rows, dtype=np.int64)
        writer.write(recs, {n: a[idx] for n, a in arrays.items()})
        rows.clear()
        recs.clear()

    for i, rec in enumerate(iter_stored_records(old)):
        seen.add(rec["id"])
        if rec["id"] in drop:
            continue
        rows.append(i)
        recs.append(rec)
        kept += 1
        if len(rows) == 8192:
            flush()
    if rows:
        flush()
    return kept, seen


def update(
    root: Path,
    upsert: Path | None,
    delete: Path | None,
    opts: JobOptions,
    model_dir: Path | None = None,
    spec_given: bool = False,
) -> JobResult:
    """A new version from the current one: deletes first, then upserts; untouched rows keep
    their stored embeddings and are never re-encoded."""
    if upsert is None and delete is None:
        raise RecordError("update needs --upsert FILE and/or --delete IDS_FILE")
    with artifact.root_lock(root):
        artifact.clean_staging(root)
        old = artifact.current_version_dir(root)
        manifest = artifact.read_manifest(old)
        model_dir = model_dir or Path(manifest["model"]["path"])
        fp = fingerprint(model_dir)
        if fp != manifest["model"]["fingerprint"]:
            raise artifact.ArtifactError(
                f"model {model_dir} (fingerprint {fp}) differs from the one that built version "
                f"{old.name} ({manifest['model']['fingerprint']}): embeddings would mix models; "
                "run a full `hclip index build` instead"
            )
        model = load_model(model_dir)
        if not spec_given:
            opts.spec = _previous_spec(manifest)
        if opts.views is None:
            opts.views = [tuple(v["query"]) for v in manifest["views"].values()]
        deleted = set(_read_ids(delete)) if delete else set()
        replaced = _upsert_ids(upsert) if upsert else set()
        stage = artifact.staging_dir(root, artifact.new_version_id())
        try:
            writer = RowWriter(stage, model.names, model.cfg.latent_dim)
            validator = Validator(model, upsert.parent if upsert else root, skip_bad=opts.skip_bad)
            try:
                kept, old_ids = _copy_rows(old, writer, deleted | replaced)
                encoded = 0
                if upsert:
                    encoded = encode_records(
                        model,
                        iter_records(upsert),
                        validator,
                        writer,
                        opts.batch_size,
                        opts.progress,
                    )
            finally:
                writer.close()
            missing = deleted - old_ids
            extra = {
                "update": {
                    "kept": kept,
                    "encoded": encoded,
                    "deleted": len(deleted - missing),
                    "deleted_not_found": sorted(missing)[:1000],
                }
            }
            return _finish(root, stage, model, manifest["model"], opts, validator, old.name, extra)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _previous_spec(manifest: dict[str, Any]) -> IndexSpec:
    specs = [IndexSpec.from_dict(v["spec"]) for v in manifest["views"].values() if v["count"]]
    approx = [s for s in specs if not s.exact]
    return approx[0] if approx else IndexSpec("flat")


def summary(result: JobResult) -> Iterator[str]:
    m = result.manifest
    yield f"published version {result.version} ({m['counts']['records']} records)"
    for name, v in m["views"].items():
        kind, recall = v["spec"]["kind"], v["recall_at_10"]
        yield f"  view {name:<20} {v['count']:>9} records  {kind:<6} recall@10 {recall}"
    for r in result.rejected:
        yield f"  rejected line {r['line']} id {r['id']!r}: {r['reason']}"
