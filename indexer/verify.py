"""Checking a version: quickly when a server loads it, fully for `hclip index verify` and before
a build publishes.

- quick (O(1) in the record count): every listed file is present with its size, nothing
  unlisted is there, files up to SMALL_FILE_BYTES match their checksums, and opening the version
  checks every array's shape against the manifest;
- full: every checksum, the record store's internal consistency (ids hash to their index
  entries, payloads are JSON objects), each view holds exactly the rows that have its target
  modalities, and each flat view's vectors equal the products recomputed from the stored
  embeddings.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from indexer import artifact
from indexer.arrays import NpyRows
from indexer.reader import LoadedVersion, embedding_path, load_rows
from indexer.recordstore import RecordStore, id_hash_of
from indexer.specs import IndexSpec
from indexer.views import CHUNK, factor_chunks
from models.heads import build_head

SMALL_FILE_BYTES = 1 << 20


def verify_files(vdir: Path, full: bool = True) -> list[str]:
    """Problems with a version's files: missing, resized, altered or unlisted."""
    try:
        manifest = artifact.read_manifest(vdir)
    except artifact.ArtifactError as exc:
        return [str(exc)]
    problems = []
    files = manifest.get("files", {})
    on_disk = set(artifact.list_files(vdir)) if vdir.is_dir() else set()
    for rel, meta in files.items():
        path = vdir / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: size {path.stat().st_size} != {meta['bytes']}")
        elif (full or meta["bytes"] <= SMALL_FILE_BYTES) and not artifact.file_matches(path, meta):
            problems.append(f"{rel}: checksum mismatch")
    problems += [f"{rel}: not listed in the manifest" for rel in sorted(on_disk - set(files))]
    return problems


def verify_contents(vdir: Path) -> list[str]:
    """The O(N) checks, streamed (memory: one chunk, whatever the version's size): the record
    store's consistency, each view's rows, and each flat view's vectors recomputed."""
    manifest = artifact.read_manifest(vdir)
    names: list[str] = manifest["modalities"]
    # The record store's check is Python (a hash per id), the views' numpy: two threads.
    # Every file is opened on this thread: np.load parses .npy headers with `ast`, which
    # CPython before 3.11.8 could not run on two threads at once (gh-106905: a SystemError).
    store = RecordStore(vdir, names, manifest.get("filter_fields"), id_hash_of(manifest))
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="hclip-verify") as pool:
            store_problems = pool.submit(store.problems)
            problems = _view_problems(vdir, names, manifest)
            return store_problems.result() + problems
    finally:
        store.close()


def _view_problems(vdir: Path, names: list[str], manifest: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    stored = load_rows(vdir, names, mmap=False)
    cfg = manifest["model"]["config"]
    # Record factors are parameter-free for every head, so no weights are needed to recompute.
    head = build_head(cfg["head"], names, cfg["latent_dim"])
    for name, entry in manifest["views"].items():
        target = tuple(entry["target"])
        expected = stored.rows_with(target)
        rows = np.load(vdir / artifact.VIEWS / f"{name}.rows.npy")
        if not np.array_equal(rows, expected):
            problems.append(f"view {name}: rows differ from the records that have {target}")
            continue
        if not IndexSpec.from_dict(entry["spec"]).exact:
            continue
        path = vdir / artifact.VIEWS / f"{name}.npy"
        vectors = NpyRows(path)
        if vectors.shape[0] != len(rows):
            problems.append(f"view {name}: {vectors.shape[0]} vectors for {len(rows)} rows")
            continue
        chunks = factor_chunks(head, stored, expected, target, "record")
        if len(target) == 1 and os.path.samefile(path, embedding_path(vdir, target[0])):
            # A link to the stored embeddings (indexer.views.FlatViewsWriter): the same bytes,
            # so what is left to check is that the head's factor of this one modality is its
            # embeddings as they are, which one chunk shows.
            chunks = itertools.islice(chunks, 1)
        for i, xb in enumerate(chunks):
            start = i * CHUNK
            got = vectors[np.arange(start, start + xb.shape[0])]
            if not np.array_equal(got, xb) and not np.allclose(got, xb, rtol=1e-5, atol=1e-6):
                problems.append(f"view {name}: vectors at positions {start}.. differ")
                break
    return problems


def verify(vdir: Path) -> list[str]:
    """Every problem found in one version: its files first, then its contents."""
    problems = verify_files(vdir, full=True)
    if problems:
        return problems
    try:
        LoadedVersion(vdir).records.close()  # opens: every shape checked against the manifest
        return verify_contents(vdir)
    except Exception as exc:  # any failure to open or read is a verification failure, reported
        return [f"cannot open: {exc}"]
