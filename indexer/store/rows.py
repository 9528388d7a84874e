"""A version's rows as the view code reads them: the per-modality embeddings (memory-mapped
for serving, read in spans by build jobs) with the presence flags, and the head's factors of
any set of rows computed from them in chunks (docs/design.md §1)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from indexer.search.ann import ExactVectors
from indexer.store import artifact, fp16_file
from indexer.store.arrays import NpyRows
from indexer.store.recordstore import RecordStore
from models.heads import Head

CHUNK = 8192  # rows whose factors are computed at once


@dataclass
class StoredRows:
    """The version's rows: per-modality embeddings (memory-mapped, or read in spans by build
    jobs) and which rows have each modality."""

    names: Sequence[str]
    embeddings: Mapping[str, Any]  # name -> (N, d): np.ndarray or NpyRows
    presence: np.ndarray  # (N, m) bool, columns in `names` order

    @property
    def count(self) -> int:
        return int(self.presence.shape[0])

    def present(self, name: str) -> np.ndarray:
        return np.asarray(self.presence[:, list(self.names).index(name)])  # (N,) bool

    def rows_with(self, names: Sequence[str]) -> np.ndarray:
        mask = np.logical_and.reduce([self.present(n) for n in names])
        return np.flatnonzero(mask).astype(np.int64)


@torch.no_grad()
def factor_chunks(
    head: Head, stored: StoredRows, rows: np.ndarray, names: Sequence[str], side: str
) -> Iterator[np.ndarray]:
    """The record (side='record') or query factor of `rows`, CHUNK rows at a time."""
    for start in range(0, len(rows), CHUNK):
        idx = rows[start : start + CHUNK]
        # float32 whatever the store holds: a compact version's float16 widened exactly
        embs = {
            n: torch.from_numpy(np.asarray(stored.embeddings[n][idx], dtype=np.float32))
            for n in names
        }
        if side == "record":
            out = head.record_factor(embs, tuple(names))
        else:
            out = head.query_factor(embs, tuple(names))
        yield np.ascontiguousarray(out.numpy(), dtype=np.float32)


def embedding_path(vdir: Path, name: str) -> Path:
    """embeddings/<name>.npy (float32), or in a compact version embeddings/<name>.faiss
    (float16, indexer.store.fp16_file): whichever the version holds."""
    half = compact_embedding_path(vdir, name)
    return half if half.exists() else vdir / artifact.EMBEDDINGS / f"{name}.npy"


def compact_embedding_path(vdir: Path, name: str) -> Path:
    return vdir / artifact.EMBEDDINGS / f"{name}{COMPACT_SUFFIX}"


COMPACT_SUFFIX = ".faiss"


def map_embeddings(vdir: Path, name: str) -> np.ndarray:
    """(N, d) float32 or float16 embeddings of one modality, memory-mapped read-only."""
    path = embedding_path(vdir, name)
    if path.suffix == COMPACT_SUFFIX:
        return fp16_file.map_rows(path)
    return np.load(path, mmap_mode="r")


def read_embeddings(vdir: Path, name: str) -> NpyRows:
    """One modality's embeddings read in spans as float32 (build jobs: see NpyRows)."""
    path = embedding_path(vdir, name)
    if path.suffix == COMPACT_SUFFIX:
        return NpyRows(path, fp16_file.layout(path))
    return NpyRows(path)


def load_rows(vdir: Path, names: list[str], mmap: bool = True) -> StoredRows:
    """Memory-mapped for serving; plain chunked reads for build jobs (see NpyRows)."""
    embeddings: dict[str, Any] = {
        n: map_embeddings(vdir, n) if mmap else read_embeddings(vdir, n) for n in names
    }
    store = RecordStore(vdir, names)
    presence = store.presence if mmap else np.array(store.presence)
    return StoredRows(names=names, embeddings=embeddings, presence=presence)


def mapped_rows(vdir: Path, stored: StoredRows) -> StoredRows:
    """The version's embeddings memory-mapped, as the server reads them: re-ranking is timed
    (indexer.tune) and run (measure_recall) on the path that serves it."""
    embeddings = {n: map_embeddings(vdir, n) for n in stored.names}
    return StoredRows(stored.names, embeddings, stored.presence)


def exact_vectors_of(
    head: Head, stored: StoredRows, rows: np.ndarray, target: Sequence[str]
) -> ExactVectors:
    """positions -> the view's exact vectors, recomputed from the stored embeddings."""

    def vectors(positions: np.ndarray) -> np.ndarray:
        chunks = factor_chunks(head, stored, rows[positions], target, "record")
        return np.concatenate([np.zeros((0, head.factor_dim), np.float32), *chunks])

    return vectors
