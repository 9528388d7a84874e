"""Checking a version: quickly when a server loads it, fully for `hclip index verify` and before
a build publishes.

- quick (O(1) in the record count): every listed file is present with its size, nothing
  unlisted is there, files up to SMALL_FILE_BYTES match their checksums, and opening the version
  checks every array's shape against the manifest;
- full: every checksum, the record store's internal consistency (ids hash to their index
  entries, payloads are JSON objects), each view holds exactly the rows that have its target
  modalities, and each flat view's vectors (a compact version's float16 views too) equal the
  products recomputed from the stored embeddings; a compact version's codes are checked by
  their checksums.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from indexer.search.specs import IndexSpec
from indexer.store import artifact, fp16_file
from indexer.store.arrays import NpyRows
from indexer.store.recordstore import RecordStore, id_hash_of
from indexer.store.rows import CHUNK, StoredRows, embedding_path, load_rows
from indexer.store.version import LoadedVersion
from models.heads import Head, build_head

SMALL_FILE_BYTES = 1 << 20


def verify_files(vdir: Path, full: bool = True) -> list[str]:
    """Problems with a version's files: missing, resized, altered or unlisted."""
    try:
        manifest = artifact.read_manifest(vdir)
    except artifact.ArtifactError as exc:
        return [str(exc)]
    problems = []
    if manifest.get("version") != vdir.name:  # a copy under another name, manifest unedited
        problems.append(
            f"{artifact.MANIFEST}: names version {manifest.get('version')!r}, but it lies in "
            f"directory {vdir.name!r}"
        )
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


@dataclass
class _FlatView:
    """A flat view whose vectors are to be recomputed: its target's columns in the presence
    flags, its vectors, whether its file is the stored embeddings of its one target modality,
    and how many of its positions are checked so far."""

    name: str
    target: tuple[str, ...]
    columns: list[int]
    vectors: NpyRows
    linked: bool
    checked: int = 0
    problem: str | None = None


def _view_problems(vdir: Path, names: list[str], manifest: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    stored = load_rows(vdir, names, mmap=False)
    flat: list[_FlatView] = []
    for name, entry in manifest["views"].items():
        target = tuple(entry["target"])
        expected = stored.rows_with(target)
        rows = np.load(vdir / artifact.VIEWS / f"{name}.rows.npy")
        if not np.array_equal(rows, expected):
            problems.append(f"view {name}: rows differ from the records that have {target}")
            continue
        spec = IndexSpec.from_dict(entry["spec"])
        if spec.kind == "fp16":  # a compact version's float16 view (indexer.build.compact)
            path = vdir / artifact.VIEWS / f"{name}.faiss"
            try:
                vectors = NpyRows(path, fp16_file.layout(path))
            except fp16_file.Fp16FileError as exc:
                problems.append(f"view {name}: {exc}")
                continue
        elif not spec.exact:
            continue
        else:
            path = vdir / artifact.VIEWS / f"{name}.npy"
            vectors = NpyRows(path)
        if vectors.shape[0] != len(rows):
            problems.append(f"view {name}: {vectors.shape[0]} vectors for {len(rows)} rows")
            continue
        # A link to the stored embeddings (indexer.build.views.FlatViewsWriter): the same bytes, so
        # what is left to check is that the head's factor of this one modality is its
        # embeddings as they are, which the first chunk shows.
        linked = len(target) == 1 and os.path.samefile(path, embedding_path(vdir, target[0]))
        columns = [names.index(n) for n in target]
        flat.append(_FlatView(name, target, columns, vectors, linked))
    cfg = manifest["model"]["config"]
    # Record factors are parameter-free for every head, so no weights are needed to recompute.
    head = build_head(cfg["head"], names, cfg["latent_dim"])
    _recompute(head, stored, flat)
    return problems + [f"view {v.name}: {v.problem}" for v in flat if v.problem]


@torch.no_grad()
def _recompute(head: Head, stored: StoredRows, views: list[_FlatView]) -> None:
    """Each view's vectors against the factors recomputed from the stored embeddings, CHUNK
    record rows at a time, reading each modality's rows once for every view that needs them.
    A view holds, in order, the records that have its target modalities, so a chunk's share
    of it is the next span of positions, found from the presence flags alone (no list of rows
    per view: 8 bytes a record each). The first mismatch of a view is its `problem`.

    One pass, not a view at a time: reading is most of this check, and views that share a
    modality would each read its embeddings again."""
    for start in range(0, stored.count, CHUNK):
        stop = min(start + CHUNK, stored.count)
        todo = [v for v in views if v.problem is None and (not v.linked or start == 0)]
        if not todo:
            return
        needed = sorted({n for v in todo for n in v.target})
        span = np.arange(start, stop)
        embs = {n: torch.from_numpy(np.asarray(stored.embeddings[n][span])) for n in needed}
        presence = np.asarray(stored.presence[start:stop])
        for v in todo:
            mine = np.flatnonzero(presence[:, v.columns].all(axis=1))
            lo, hi = v.checked, v.checked + len(mine)
            v.checked = hi
            if lo == hi:
                continue
            at = torch.from_numpy(mine)
            part = {n: embs[n] if hi - lo == stop - start else embs[n][at] for n in v.target}
            want = np.ascontiguousarray(head.record_factor(part, v.target).numpy(), "<f4")
            got = v.vectors[np.arange(lo, hi)]
            if not np.array_equal(got, want) and not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                v.problem = f"vectors at positions {lo}.. differ"


def verify(vdir: Path) -> list[str]:
    """Every problem found in one version: its files first, then its contents."""
    problems = verify_files(vdir, full=True)
    if problems:
        return problems
    try:
        LoadedVersion(vdir).records.close()  # opens: every shape checked against the manifest
        problems = verify_contents(vdir)
    except Exception as exc:  # any failure to open or read is a verification failure, reported
        return [f"cannot open: {exc}"]
    manifest = artifact.read_manifest(vdir)
    if not problems and (manifest.get("backend") or {}).get("kind") == "milvus":
        from indexer.store import milvus_served  # pymilvus: only for Milvus versions

        problems = milvus_served.verify_backend(vdir, manifest)
    return problems
