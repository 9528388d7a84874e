"""Where a job's version is served from: local FAISS files (the version directory alone) or
Milvus collections written beside it (indexer.build.milvus_export)."""

from __future__ import annotations

import logging
from pathlib import Path

from indexer.build import milvus_export
from indexer.build.options import JobOptions
from indexer.search.specs import IndexSpec
from indexer.store import artifact, milvus

log = logging.getLogger(__name__)

# The milvus backend's target and the spec its collections get; None: local FAISS files.
Target = tuple[milvus_export.MilvusTarget, IndexSpec] | None


def choose_backend(root: Path, opts: JobOptions, previous: str | None = None) -> Target:
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
