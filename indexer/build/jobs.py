"""`index build` and `index update`: stage a complete version, check it, publish it atomically."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.build import milvus_export
from indexer.build.local import chunk_rows_for, encode_local
from indexer.build.views import FlatViewsWriter, build_view
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.checks import ChunkChecker
from indexer.ingest.sources import CHUNK_ROWS, RecordFiles
from indexer.ingest.validate import Rejected, Validator
from indexer.search.specs import IndexSpec
from indexer.store import artifact, milvus
from indexer.store.arrays import NpyRows
from indexer.store.recordstore import ID_HASH_KIND, RecordStore, id_hash_of
from indexer.store.rows import StoredRows, embedding_path, load_rows
from indexer.store.verify import verify_contents
from indexer.store.version import LoadedVersion
from models.checkpoint import fingerprint, load_model, read_config
from models.extras import require
from models.heads import default_views
from models.model import MultimodalModel
from models.records import RecordError

log = logging.getLogger(__name__)

MANIFEST_REJECTS = 100  # inline in the manifest; rejected.jsonl lists every one
UPSERTS = "upserts.tmp"  # inside a staged update: upserts encoded before any old row is dropped


@dataclass
class JobOptions:
    spec: IndexSpec = field(default_factory=lambda: IndexSpec("flat"))
    views: list[tuple[str, ...]] | None = None  # None: the default set (docs/design.md §4)
    batch_size: int = 256
    skip_bad: bool = False
    progress: bool = True
    check: bool = True  # the full verification of the staged version before it is published
    filter_fields: tuple[str, ...] | None = None  # None: none at build, the old ones at update
    engine: str = "local"  # or "ray" (indexer.build.ray_engine)
    ray_address: str | None = None  # None: a local Ray started and stopped by the job
    workers: int | None = None  # Ray encoding actors; None: one per CPU that Ray offers
    chunk_rows: int = CHUNK_ROWS  # records checked at once (local), per block and shard (Ray)
    backend: str | None = None  # "faiss" or "milvus"; None: the root's (ROOT/backend.json)
    milvus_uri: str | None = None  # None: the root's
    shards: int = 1  # Milvus shards per collection
    device: str = "auto"  # where the local engine encodes: auto (a GPU if any), cpu, cuda


@dataclass
class JobResult:
    version: str
    path: Path
    manifest: dict[str, Any]
    rejected: list[Rejected] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, for benchmarks


def _model_block(model_dir: Path, fp: str) -> dict[str, Any]:
    _, raw = read_config(model_dir)
    return {
        "path": str(model_dir.resolve()),
        "fingerprint": fp,
        "config": {k: raw[k] for k in ("modalities", "head", "latent_dim")},
    }


def _full_check(stage: Path) -> list[str]:
    LoadedVersion(stage).records.close()  # opening checks every shape against the manifest
    return verify_contents(stage)


ENGINES = ("local", "ray")


def _encode(
    model: MultimodalModel,
    model_dir: Path,
    files: RecordFiles,
    validator: Validator,
    admission: Admission,
    writer: RowWriter,
    opts: JobOptions,
) -> int:
    """Check, encode and write every record of `files` with the chosen engine; rows written."""
    rows = chunk_rows_for(model, opts.batch_size, opts.chunk_rows)
    if opts.engine == "ray":
        require("ray.data", "ray", "--engine ray")
        from indexer.build.ray_engine import RayJob  # imports ray: only for this engine

        job = RayJob(model_dir, opts.ray_address, opts.workers, opts.batch_size, opts.progress)
        return job.run(model, files, validator, admission, writer, rows)
    checker = ChunkChecker(validator)
    batch = opts.batch_size
    return encode_local(model, files, checker, admission, writer, batch, rows, opts.progress)


def _engine_block(opts: JobOptions) -> dict[str, Any]:
    if opts.engine == "ray":
        return {"name": "ray", "address": opts.ray_address, "workers": opts.workers}
    return {"name": "local"}


def _build_views(
    stage: Path, model: MultimodalModel, stored: StoredRows, opts: JobOptions
) -> list[dict[str, Any]]:
    """Every approximate or tuned view's manifest entry, in order, built one by one from the
    stored embeddings: FAISS spreads one build over the cores itself, and a tuner's timings
    must not share the machine with another view."""
    queries = opts.views or default_views(model.names)
    return [build_view(stage, model.head, stored, q, opts.spec) for q in queries]


def _views_writer(stage: Path, model: MultimodalModel, opts: JobOptions) -> FlatViewsWriter | None:
    """Exact views are written with the rows (indexer.build.views.FlatViewsWriter); the others are
    built from the stored embeddings once every row is in."""
    if not opts.spec.exact or opts.spec.tuned:
        return None
    return FlatViewsWriter(stage, model.head, opts.views or default_views(model.names), opts.spec)


def _write_rejects(stage: Path, rejected: list[Rejected]) -> None:
    if rejected:
        with open(stage / artifact.REJECTED, "wb") as f:
            for r in rejected:
                f.write(orjson.dumps(r.to_dict()) + b"\n")


def _finish(
    root: Path,
    stage: Path,
    model: MultimodalModel,
    model_block: dict[str, Any],
    opts: JobOptions,
    rejected: list[Rejected],
    parent: str | None,
    extra: dict[str, Any],
    fields: dict[str, dict[str, Any]],
    timings: dict[str, float],
    written: FlatViewsWriter | None,
    target: Target = None,
) -> JobResult:
    """Build every view from the staged embeddings (or finish those written with the rows),
    write the manifest, check and publish; on the milvus backend (`target`), write the
    collections first: CURRENT names the version only once every one is loaded."""
    stored = load_rows(stage, model.names, mmap=False)
    if stored.count == 0:
        raise RecordError("no valid records: nothing to index")
    start = time.perf_counter()
    views = {}
    entries = written.finish() if written else _build_views(stage, model, stored, opts)
    for entry in entries:
        views["+".join(entry["query"])] = entry
    timings["views_s"] = time.perf_counter() - start
    _write_rejects(stage, rejected)
    manifest = {
        "format_version": artifact.FORMAT_VERSION,
        "version": stage.name,
        "parent": parent,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_block,
        "modalities": model.names,
        "d": model.cfg.latent_dim,
        "id_hash": ID_HASH_KIND,  # indexer.store.recordstore: the store's id hash
        "counts": {
            "records": stored.count,
            "by_modality": {n: int(stored.present(n).sum()) for n in model.names},
            "rejected": len(rejected),
        },
        "views": views,
        "filter_fields": fields,
        "rejected": [r.to_dict() for r in rejected[:MANIFEST_REJECTS]],
        "rejected_file": artifact.REJECTED if rejected else None,
        "engine": _engine_block(opts),
        **extra,
    }

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
        path = artifact.publish(root, stage, manifest, check if opts.check else None)
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
    return JobResult(stage.name, path, manifest, list(rejected), timings)


Target = tuple[milvus_export.MilvusTarget, IndexSpec] | None


def _backend(root: Path, opts: JobOptions, previous: str | None = None) -> Target:
    """The job's backend: --backend, else the version it updates (`previous`), else the
    root's; for milvus, its target and the spec its collections get, the local views staying
    flat (their vectors are what the collections are written from). Records the root's
    backend and drops collections no published version names (only with the lock held)."""
    config = milvus.read_root(root)
    kind = opts.backend or previous or (config["kind"] if config else "faiss")
    if config is not None and config.get("uri"):
        try:
            milvus.drop_unpublished(root)
        except artifact.BackendUnavailable as exc:
            if kind == "milvus":
                raise
            log.warning("collections left in Milvus not dropped: %s", exc)
    if kind == "faiss":
        if config is not None and config["kind"] != "faiss":
            milvus.write_root(root, "faiss", None)
        return None
    uri = opts.milvus_uri or (config or {}).get("uri")
    if not uri:
        raise artifact.ArtifactError("--backend milvus needs --milvus-uri (a Milvus Lite file "
                                     "path, or http://host:19530)")  # fmt: skip
    spec = opts.spec
    milvus_export.index_of(spec, 1)  # a spec Milvus cannot build stops here, before encoding
    milvus.connect(uri).close()  # an unreachable Milvus stops the job before it encodes
    config = milvus.write_root(root, "milvus", uri)
    opts.spec = IndexSpec("flat")
    return milvus_export.MilvusTarget(uri, str(config["prefix"]), opts.shards), spec


def build(model_dir: Path, records_path: Path, root: Path, opts: JobOptions) -> JobResult:
    """A full build: every record of `records_path` (a file, a directory or a glob)."""
    model = load_model(model_dir).to_inference(opts.device, field="--device")
    block = _model_block(model_dir, fingerprint(model_dir))
    files = RecordFiles.resolve(records_path)
    with artifact.root_lock(root):
        artifact.clean_staging(root)
        target = _backend(root, opts)
        stage = artifact.staging_dir(root, artifact.new_version_id())
        with artifact.removed_on_failure(root, stage):
            fields = opts.filter_fields or ()
            views = _views_writer(stage, model, opts)
            writer = RowWriter(stage, model.names, model.cfg.latent_dim, fields, views)
            validator = Validator(model, files.base_dir, opts.skip_bad, fields)
            admission = Admission(files, opts.skip_bad)
            start = time.perf_counter()
            try:
                _encode(model, model_dir, files, validator, admission, writer, opts)
            finally:
                writer.close()
            timings = {"encode_s": time.perf_counter() - start}
            extra = {"source": {"records": str(Path(records_path).resolve())}}
            parent = artifact.read_current(root)
            info = writer.store.fields_info
            rejected = admission.rejected
            return _finish(
                root,
                stage,
                model,
                block,
                opts,
                rejected,
                parent,
                extra,
                info,
                timings,
                views,
                target,
            )


def _read_ids(path: Path) -> list[str]:
    try:
        text = path.read_text()  # a pipe (`<(...)`) is fine too, so no is_file() check
    except FileNotFoundError:
        raise RecordError(f"ids file not found: {path}") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _stored_ids(vdir: Path, names: list[str]) -> set[str]:
    """Every id in the record store of the version (or staged part) at `vdir`."""
    store = RecordStore(vdir, names)
    try:
        return {rid for _, ids, _, _ in store.iter_chunks() for rid in ids}
    finally:
        store.close()


def _copy_rows(
    src: Path, names: list[str], writer: RowWriter, drop: set[str] | None = None
) -> tuple[int, int]:
    """Stream rows of the version (or staged part) at `src` whose ids are not in `drop` into
    `writer`, with their stored embeddings and payloads as stored; (rows kept, rows dropped)."""
    store = RecordStore(src, names)  # its own field columns are not read: the writer's are
    # built anew from the payloads, so a field can be declared or dropped by an update
    arrays = {n: NpyRows(embedding_path(src, n)) for n in names}
    kept = dropped = 0
    for start, ids, payloads, presence in store.iter_chunks():
        keep = [i for i, rid in enumerate(ids) if not drop or rid not in drop]
        dropped += len(ids) - len(keep)
        if not keep:
            continue
        idx = np.asarray(keep, dtype=np.int64)
        writer.write_rows(
            [ids[i] for i in keep],
            [payloads[i] for i in keep],
            presence[idx],
            {n: a[start + idx] for n, a in arrays.items()},
        )
        kept += len(keep)
    store.close()
    return kept, dropped


def update(
    root: Path,
    upsert: Path | None,
    delete: Path | None,
    opts: JobOptions,
    model_dir: Path | None = None,
    spec_given: bool = False,
) -> JobResult | None:
    """A new version from the current one: deletes first, then upserts; untouched rows keep
    their stored embeddings and are never re-encoded. None, and nothing published, when it
    would change nothing: no record upserted or deleted, and the same spec, views and fields.

    Upserts are validated and encoded (into a side part of the staged version) before any old
    row is dropped, so an invalid upsert of an existing id, left out by --skip-bad, keeps the
    old record. The new version must hold exactly the old rows that were neither deleted nor
    validly replaced, plus the valid upserts: anything else stops the update.
    """
    if upsert is None and delete is None:
        raise RecordError("update needs --upsert FILE and/or --delete IDS_FILE")
    layout_given = spec_given or opts.views is not None or opts.filter_fields is not None
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
        model = load_model(model_dir).to_inference(opts.device, field="--device")
        if not spec_given:
            opts.spec = _previous_spec(manifest)
        target = _backend(root, opts, (manifest.get("backend") or {}).get("kind"))
        if opts.views is None:
            opts.views = [tuple(v["query"]) for v in manifest["views"].values()]
        if opts.filter_fields is None:
            opts.filter_fields = tuple(manifest.get("filter_fields") or {})
        fields = opts.filter_fields
        # Each column keeps the type the version it updates gave it (a numeric year stays one).
        declared = manifest.get("filter_fields") or {}
        types = {n: str(declared[n]["type"]) for n in fields if n in declared}
        deleted = set(_read_ids(delete)) if delete else set()
        files = RecordFiles.resolve(upsert) if upsert else None
        stage = artifact.staging_dir(root, artifact.new_version_id())
        with artifact.removed_on_failure(root, stage):
            side = stage / UPSERTS
            side.mkdir()
            side_writer = RowWriter(side, model.names, model.cfg.latent_dim)
            admission = None
            start = time.perf_counter()
            try:
                encoded = 0
                if files is not None:
                    validator = Validator(model, files.base_dir, opts.skip_bad, fields, types)
                    admission = Admission(files, opts.skip_bad)
                    encoded = _encode(
                        model, model_dir, files, validator, admission, side_writer, opts
                    )
            finally:
                side_writer.close()
            # only upserts that passed validation replace stored records
            replaced = _stored_ids(side, model.names) if admission else set()
            rejected = admission.rejected if admission else []
            timings = {"encode_s": time.perf_counter() - start}
            old_store = RecordStore(old, model.names, id_hash=id_hash_of(manifest))
            deleted_found = {i for i in deleted if old_store.row_of(i) is not None}
            old_count = len(old_store)
            old_store.close()
            if encoded == 0 and not deleted_found and not layout_given:
                shutil.rmtree(stage)  # every skipped record was logged as it was skipped
                return None
            views = _views_writer(stage, model, opts)
            writer = RowWriter(stage, model.names, model.cfg.latent_dim, fields, views, types)
            try:
                kept, dropped = _copy_rows(old, model.names, writer, deleted | replaced)
                appended, _ = _copy_rows(side, model.names, writer)
            finally:
                writer.close()
            shutil.rmtree(side)
            if kept != old_count - dropped or appended != encoded or writer.rows != kept + encoded:
                raise artifact.ArtifactError(
                    f"update would publish {writer.rows} records, expected {kept} kept + "
                    f"{encoded} upserted: refusing to publish"
                )
            missing = deleted - deleted_found
            extra = {
                "update": {
                    "kept": kept,
                    "encoded": encoded,
                    "replaced": dropped - len(deleted_found),
                    "deleted": len(deleted_found),
                    "deleted_not_found": sorted(missing)[:1000],
                }
            }
            info = writer.store.fields_info
            return _finish(
                root,
                stage,
                model,
                manifest["model"],
                opts,
                rejected,
                old.name,
                extra,
                info,
                timings,
                views,
                target,
            )


def _previous_spec(manifest: dict[str, Any]) -> IndexSpec:
    backend = manifest.get("backend") or {}
    entries = backend.get("views") or manifest["views"]  # Milvus's indexes, where it holds them
    specs = [IndexSpec.from_dict(v["spec"]) for n, v in entries.items()
             if manifest["views"][n]["count"]]  # fmt: skip
    approx = [s for s in specs if not s.exact]
    return approx[0] if approx else IndexSpec("flat")


def summary(result: JobResult) -> Iterator[str]:
    m = result.manifest
    yield f"published version {result.version} ({m['counts']['records']} records)"
    for name, v in m["views"].items():
        kind, recall = v["spec"]["kind"], v["recall_at_10"]
        yield f"  view {name:<20} {v['count']:>9} records  {kind:<6} recall@10 {recall}"
    for r in result.rejected:
        yield f"  rejected {r.where()}: {r.reason}"
