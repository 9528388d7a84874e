"""The engine a job encodes with: local (indexer.build.local) or Ray (indexer.build.ray_engine),
and the manifest's record of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from indexer.build.local import chunk_rows_for, encode_local
from indexer.build.options import JobOptions
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.checks import ChunkChecker
from indexer.ingest.sources import RecordFiles
from indexer.ingest.validate import Validator
from models.extras import require
from models.model import MultimodalModel


def encode_records(
    model: MultimodalModel,
    model_dir: Path,
    files: RecordFiles,
    validator: Validator,
    admission: Admission,
    writer: RowWriter,
    opts: JobOptions,
) -> int:
    """Check, encode and write every record of `files` with the chosen engine; rows written.
    Raises every bad record found, unless --skip-bad left them out."""
    rows = chunk_rows_for(model, opts.batch_size, opts.chunk_rows)
    if opts.engine == "ray":
        require("ray.data", "ray", "--engine ray")
        from indexer.build.ray_engine import RayJob  # imports ray: only for this engine

        job = RayJob(model_dir, opts.ray_address, opts.workers, opts.batch_size, opts.progress)
        written = job.run(model, files, validator, admission, writer, rows)
    else:
        checker = ChunkChecker(validator)
        batch = opts.batch_size
        written = encode_local(model, files, checker, admission, writer, batch, rows, opts.progress)
    admission.finish(model.names)
    return written


def engine_block(opts: JobOptions) -> dict[str, Any]:
    if opts.engine == "ray":
        return {"name": "ray", "address": opts.ray_address, "workers": opts.workers}
    return {"name": "local"}
