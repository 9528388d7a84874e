"""Reading a version back: records, memory-mapped embeddings, view indexes, search and verify."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import orjson

from indexer import artifact
from indexer.arrays import NpyRows
from indexer.specs import IndexSpec, pad_queries, set_search_params
from indexer.views import CHUNK, StoredRows, factor_chunks
from models.heads import build_head

log = logging.getLogger(__name__)


def iter_stored_records(vdir: Path) -> Iterator[dict[str, Any]]:
    with open(vdir / artifact.RECORDS, "rb") as f:
        for line in f:
            yield orjson.loads(line)


def read_records(vdir: Path) -> list[dict[str, Any]]:
    return list(iter_stored_records(vdir))


def read_presence(vdir: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Which rows have each modality, streamed from records.jsonl (a byte per row and name)."""
    flags: dict[str, list[bool]] = {n: [] for n in names}
    for rec in iter_stored_records(vdir):
        have = set(rec["modalities"])
        for n in names:
            flags[n].append(n in have)
    return {n: np.array(v, dtype=bool) for n, v in flags.items()}


def load_rows(vdir: Path, names: list[str], mmap: bool = True) -> StoredRows:
    """Memory-mapped for serving; plain chunked reads for build jobs (see NpyRows)."""
    paths = {n: vdir / artifact.EMBEDDINGS / f"{n}.npy" for n in names}
    embeddings: dict[str, Any] = {
        n: np.load(p, mmap_mode="r") if mmap else NpyRows(p) for n, p in paths.items()
    }
    return StoredRows(embeddings=embeddings, present=read_presence(vdir, names))


@dataclass
class View:
    name: str
    query: tuple[str, ...]
    target: tuple[str, ...]
    spec: IndexSpec
    index: faiss.Index
    rows: np.ndarray  # index position -> record row
    max_norm: float | None = None
    width: int | None = None

    def search(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, record rows), both (nq, k'); k' = min(k, view size). Scores are exact
        inner products for every index kind; rows of -1 mark missing results (IVF)."""
        k = min(k, len(self.rows))
        if k == 0:
            return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        if self.width is None:
            scores, pos = self.index.search(xq, k)
        else:
            assert self.max_norm is not None
            dist, pos = self.index.search(pad_queries(xq, self.width), k)
            qn = np.einsum("ij,ij->i", xq, xq)[:, None]
            scores = (qn + self.max_norm**2 - dist) / 2.0  # undo the MIPS-to-L2 reduction
        rows = np.where(pos >= 0, self.rows[np.clip(pos, 0, None)], -1)
        return scores, rows


class LoadedVersion:
    """One published version, opened read-only for serving."""

    def __init__(self, vdir: Path, mmap: bool = True):
        self.path = vdir
        self.manifest = artifact.read_manifest(vdir)
        self.version: str = self.manifest["version"]
        self.names: list[str] = self.manifest["modalities"]
        self.records = read_records(vdir)
        if len(self.records) != self.manifest["counts"]["records"]:
            raise artifact.ArtifactError(f"{vdir}: records.jsonl does not match the manifest")
        self.row_of = {r["id"]: i for i, r in enumerate(self.records)}
        self.stored = load_rows(vdir, self.names)
        self.views: dict[str, View] = {}
        for name, entry in self.manifest["views"].items():
            self.views[name] = self._open_view(name, entry, mmap)

    def _open_view(self, name: str, entry: dict[str, Any], mmap: bool) -> View:
        spec = IndexSpec.from_dict(entry["spec"])
        path = self.path / artifact.VIEWS / f"{name}.faiss"
        # Flat indexes are served memory-mapped: many versions can be open at little cost.
        flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if (mmap and spec.exact) else 0
        index = faiss.read_index(str(path), flags)
        set_search_params(index, spec)
        rows = np.load(self.path / artifact.VIEWS / f"{name}.rows.npy")
        aug = entry.get("augment")
        return View(
            name,
            tuple(entry["query"]),
            tuple(entry["target"]),
            spec,
            index,
            rows,
            aug["max_norm"] if aug else None,
            aug["width"] if aug else None,
        )

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["model"]["fingerprint"])

    def embeddings_of(self, row: int) -> dict[str, list[float]]:
        rec = self.records[row]
        return {n: self.stored.embeddings[n][row].tolist() for n in rec["modalities"]}


def verify_files(vdir: Path) -> list[str]:
    """Problems with a version's files: missing, resized, altered or unlisted."""
    try:
        manifest = artifact.read_manifest(vdir)
    except artifact.ArtifactError as exc:
        return [str(exc)]
    problems = []
    files = manifest.get("files", {})
    on_disk = set(artifact.file_table(vdir)) if vdir.is_dir() else set()
    for rel, meta in files.items():
        path = vdir / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{rel}: size {path.stat().st_size} != {meta['bytes']}")
        elif artifact.sha256_file(path) != meta["sha256"]:
            problems.append(f"{rel}: checksum mismatch")
    problems += [f"{rel}: not listed in the manifest" for rel in sorted(on_disk - set(files))]
    return problems


def verify_views(version: LoadedVersion) -> list[str]:
    """Problems with an opened version's views: each index must hold exactly the records that
    have its target modalities (the right rows; for flat views, the right vectors)."""
    problems = []
    cfg = version.manifest["model"]["config"]
    # Record factors are parameter-free for every head, so no weights are needed to recompute.
    head = build_head(cfg["head"], version.names, cfg["latent_dim"])
    for name, view in version.views.items():
        expected = version.stored.rows_with(view.target)
        if view.index.ntotal != len(view.rows):
            problems.append(
                f"view {name}: index holds {view.index.ntotal}, rows file {len(view.rows)}"
            )
        if not np.array_equal(view.rows, expected):
            problems.append(f"view {name}: rows differ from the records that have {view.target}")
            continue
        if view.spec.exact and view.index.ntotal == len(view.rows):
            for i, xb in enumerate(
                factor_chunks(head, version.stored, expected, view.target, "record")
            ):
                start = i * CHUNK
                got = view.index.reconstruct_n(start, xb.shape[0])
                if not np.allclose(got, xb, rtol=1e-5, atol=1e-6):
                    problems.append(f"view {name}: vectors at positions {start}.. differ")
                    break
    return problems


def verify(vdir: Path) -> list[str]:
    """Every problem found in one version: its files first, then its views."""
    problems = verify_files(vdir)
    if problems:
        return problems
    try:
        version = LoadedVersion(vdir)
    except Exception as exc:  # any failure to open is a verification failure, reported
        return [f"cannot open: {exc}"]
    return verify_views(version)
