"""View vectors (DESIGN §1, §4) from stored embeddings, one FAISS index per view, and recall.

A view queries with modalities Q and retrieves records by the product of their T = not-Q
modalities. Its record vectors are the head's record factor over T, computed from the stored
per-modality embeddings in chunks; only records that have every modality of T belong to it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from indexer.arrays import NpyAppender
from indexer.mips import augment, pad_queries
from indexer.mips import max_norm as norm_of
from indexer.specs import IndexSpec, augmented_width, new_index
from models.heads import Head, split_modalities, view_name

log = logging.getLogger(__name__)

CHUNK = 8192
RECALL_QUERIES = 200
RECALL_K = 10


def parse_views(text: str, names: Sequence[str]) -> list[tuple[str, ...]]:
    """`--views a,b+c`: explicit views instead of the default set."""
    views = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        q, _ = split_modalities(names, item.split("+"))
        views.append(q)
    if not views:
        raise ValueError("--views: no view given")
    return views


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
        embs = {n: torch.from_numpy(np.asarray(stored.embeddings[n][idx])) for n in names}
        if side == "record":
            out = head.record_factor(embs, tuple(names))
        else:
            out = head.query_factor(embs, tuple(names))
        yield np.ascontiguousarray(out.numpy(), dtype=np.float32)


def exact_topk(xq: np.ndarray, chunks: Iterator[np.ndarray], k: int) -> np.ndarray:
    """Brute-force top-k positions by inner product, merging chunk by chunk: the reference."""
    best_s = np.full((xq.shape[0], 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((xq.shape[0], 0), dtype=np.int64)
    offset = 0
    for xb in chunks:
        s = xq @ xb.T  # (nq, chunk)
        best_s = np.concatenate([best_s, s], axis=1)
        best_i = np.concatenate(
            [best_i, np.arange(offset, offset + xb.shape[0])[None].repeat(len(xq), 0)], 1
        )
        keep = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
        best_s = np.take_along_axis(best_s, keep, 1)
        best_i = np.take_along_axis(best_i, keep, 1)
        offset += xb.shape[0]
    return best_i


def sample_queries(
    head: Head, stored: StoredRows, query: Sequence[str], n: int, seed: int = 0
) -> np.ndarray:
    """Query factors built from the query modalities of sampled records (real-looking queries)."""
    rows = stored.rows_with(query)
    if len(rows) == 0:
        return np.zeros((0, head.factor_dim), dtype=np.float32)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(rows, size=min(n, len(rows)), replace=False))
    return np.concatenate(list(factor_chunks(head, stored, pick, query, "query")))


def build_view(
    vdir: Path, head: Head, stored: StoredRows, query: Sequence[str], spec: IndexSpec
) -> dict[str, Any]:
    """Write the view's vectors (views/<name>.npy, flat) or index (views/<name>.faiss) and
    views/<name>.rows.npy; return the manifest entry."""
    q, t = split_modalities(head.names, query)
    name = view_name(q)
    rows = stored.rows_with(t)
    np.save(vdir / "views" / f"{name}.rows.npy", rows)
    dim = head.factor_dim
    entry: dict[str, Any] = {
        "query": list(q),
        "target": list(t),
        "count": len(rows),
        "dim": dim,
        "spec": spec.to_dict(),
    }
    path = vdir / "views" / f"{name}.faiss"
    if spec.exact or len(rows) == 0:
        # An aligned float32 .npy, memory-mapped by the server: FAISS's exact kernels take it
        # as it is (faiss.knn), and so do torch and numpy, which a .faiss file's 45-byte
        # header would misalign.
        with NpyAppender(vdir / "views" / f"{name}.npy", dim) as w:
            for xb in factor_chunks(head, stored, rows, t, "record"):
                w.append(xb)
        entry["spec"] = IndexSpec("flat").to_dict()
        entry["recall_at_10"] = 1.0
        return entry
    max_norm = max(norm_of(xb) for xb in factor_chunks(head, stored, rows, t, "record"))
    width = augmented_width(dim, spec)
    index = new_index(spec, width, len(rows))
    if not index.is_trained:
        rng = np.random.default_rng(0)
        sample = np.sort(rng.choice(len(rows), size=min(len(rows), 50_000), replace=False))
        train = np.concatenate(list(factor_chunks(head, stored, rows[sample], t, "record")))
        index.train(augment(train, max_norm, width))
    for xb in factor_chunks(head, stored, rows, t, "record"):
        index.add(augment(xb, max_norm, width))
    faiss.write_index(index, str(path))
    entry["augment"] = {"max_norm": max_norm, "width": width}
    entry["recall_at_10"] = measure_recall(head, stored, q, t, rows, index, width)
    log.info("view %s: %s recall@10 = %.3f", name, spec.kind, entry["recall_at_10"])
    return entry


def measure_recall(
    head: Head,
    stored: StoredRows,
    q: Sequence[str],
    t: Sequence[str],
    rows: np.ndarray,
    index: faiss.Index,
    width: int,
) -> float:
    """recall@10 of the approximate index against exact search, on sampled records' queries."""
    xq = sample_queries(head, stored, q, RECALL_QUERIES, seed=1)
    if len(xq) == 0:
        return float("nan")
    k = min(RECALL_K, len(rows))
    truth = exact_topk(xq, factor_chunks(head, stored, rows, t, "record"), k)
    _, got = index.search(pad_queries(xq, width), k)
    hits = sum(len(set(a) & set(b)) for a, b in zip(truth.tolist(), got.tolist(), strict=True))
    return round(hits / (k * len(xq)), 4)
