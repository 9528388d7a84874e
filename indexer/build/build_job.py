"""`index build`: every record encoded into a staged version, then published (publish)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from indexer.build import compact
from indexer.build.backend import choose_backend
from indexer.build.engine import encode_records
from indexer.build.options import JobOptions, JobResult
from indexer.build.publish import PublishPlan, publish, views_writer
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.sources import RecordFiles
from indexer.ingest.validate import Validator
from indexer.store import artifact
from models.checkpoint import fingerprint, load_model, read_config


def build(model_dir: Path, records_path: Path, root: Path, opts: JobOptions) -> JobResult:
    """A full build: every record of `records_path` (a file, a directory or a glob)."""
    limits = opts.input_limits()
    opts.compact = bool(opts.compact)
    compact.check_options(opts)
    model = load_model(model_dir).to_inference(opts.device, field="--device")
    block = _model_block(model_dir, fingerprint(model_dir))
    files = RecordFiles.resolve(records_path)
    with artifact.root_lock(root, "build"):
        artifact.clean_staging(root)
        target = choose_backend(root, opts)
        compact.check_options(opts, milvus=target is not None)
        stage = artifact.staging_dir(root, artifact.new_version_id())
        with artifact.removed_on_failure(root, stage):
            fields = opts.filter_fields or ()
            views = views_writer(stage, model, opts)
            writer = RowWriter(stage, model.names, model.cfg.latent_dim, fields, views)
            validator = Validator(model, files.base_dir, opts.skip_bad, fields, limits=limits)
            admission = Admission(files, opts.skip_bad)
            start = time.perf_counter()
            try:
                encode_records(model, model_dir, files, validator, admission, writer, opts)
            finally:
                writer.close()
            timings = {"encode_s": time.perf_counter() - start}
            plan = PublishPlan(
                root=root,
                stage=stage,
                parent=_parent(root),
                model=model,
                model_block=block,
                opts=opts,
                rejected=tuple(admission.rejected),
                fields=writer.store.fields_info,
                extra={"source": {"records": str(Path(records_path).resolve())}},
                timings=timings,
                written=views,
                target=target,
            )
            return publish(plan)


def _parent(root: Path) -> str | None:
    """The published version, if CURRENT names one of the root: a build mends a CURRENT that
    names none (it publishes over it), and records no garbage as its parent."""
    current = artifact.read_current(root)
    return current if current and artifact.current_problem(root, current) is None else None


def _model_block(model_dir: Path, fp: str) -> dict[str, Any]:
    _, raw = read_config(model_dir)
    return {
        "path": str(model_dir.resolve()),
        "fingerprint": fp,
        "config": {k: raw[k] for k in ("modalities", "head", "latent_dim")},
    }
