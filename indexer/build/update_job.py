"""`index update`: a new version from the current one, deletes first, then upserts; untouched
rows are copied with their stored embeddings, then the version is published (publish)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from indexer.build import compact
from indexer.build.backend import choose_backend
from indexer.build.engine import encode_records
from indexer.build.options import JobOptions, JobResult
from indexer.build.publish import PublishPlan, publish, views_writer
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.sources import RecordFiles
from indexer.ingest.validate import Validator
from indexer.search.specs import BUILT_ONLY_KINDS, IndexSpec
from indexer.store import artifact
from indexer.store.recordstore import RecordStore, id_hash_of
from indexer.store.rows import read_embeddings
from indexer.store.version import built_by, is_compact
from models.checkpoint import load_model
from models.records import RecordError

UPSERTS = "upserts.tmp"  # inside a staged update: upserts encoded before any old row is dropped


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
    limits = opts.input_limits()
    with artifact.root_lock(root, "update"):
        artifact.clean_staging(root)
        old = artifact.current_version_dir(root)
        manifest = artifact.read_manifest(old)
        was_compact = is_compact(manifest)
        if opts.compact is None:  # an update keeps the version's form unless told
            opts.compact = was_compact
        layout_given = layout_given or opts.compact != was_compact
        if not spec_given:
            # the version's spec, or, switching between full and compact, the default of the
            # new form (a compact version's codes mean nothing to a full one, and back)
            same = opts.compact == was_compact
            opts.spec = _previous_spec(manifest) if same else IndexSpec("flat")
        compact.check_options(opts)
        hint = ": embeddings would mix models; run a full `hclip index build` instead"
        model_dir = built_by(manifest, model_dir, hint)
        model = load_model(model_dir).to_inference(opts.device, field="--device")
        target = choose_backend(root, opts, (manifest.get("backend") or {}).get("kind"))
        compact.check_options(opts, milvus=target is not None)
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
                    validator = Validator(
                        model, files.base_dir, opts.skip_bad, fields, types, limits
                    )
                    admission = Admission(files, opts.skip_bad)
                    encoded = encode_records(
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
            views = views_writer(stage, model, opts)
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
            counts = {
                "kept": kept,
                "encoded": encoded,
                "replaced": dropped - len(deleted_found),
                "deleted": len(deleted_found),
                "deleted_not_found": sorted(missing)[:1000],
            }
            plan = PublishPlan(
                root=root,
                stage=stage,
                parent=old.name,
                model=model,
                model_block=manifest["model"],
                opts=opts,
                rejected=tuple(rejected),
                fields=writer.store.fields_info,
                extra={"update": counts},
                timings=timings,
                written=views,
                target=target,
            )
            return publish(plan)


def _previous_spec(manifest: dict[str, Any]) -> IndexSpec:
    backend = manifest.get("backend") or {}
    entries = backend.get("views") or manifest["views"]  # Milvus's indexes, where it holds them
    specs = [IndexSpec.from_dict(v["spec"]) for n, v in entries.items()
             if manifest["views"][n]["count"]]  # fmt: skip
    approx = [s for s in specs if not s.exact and s.kind not in BUILT_ONLY_KINDS]
    return approx[0] if approx else IndexSpec("flat")


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
    arrays = {n: read_embeddings(src, n) for n in names}  # float32, from either store
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
