"""View vectors (docs/design.md §1, §4) from stored embeddings, an index per view, and recall.

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
from faiss.contrib.evaluation import knn_intersection_measure
from faiss.contrib.exhaustive_search import knn_ground_truth

from indexer import ann, artifact, tune
from indexer.ann import ExactVectors
from indexer.arrays import NpyAppender
from indexer.mips import max_norm as norm_of
from indexer.specs import IndexSpec, augmented_width, new_index
from models.heads import Head, split_modalities, view_name

log = logging.getLogger(__name__)

CHUNK = 8192
RECALL_QUERIES = 200
RECALL_K = 10
TUNE_QUERIES = 1000  # per half: the tuner's choice and its check each get this many


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


def mapped_rows(vdir: Path, stored: StoredRows) -> StoredRows:
    """The version's embeddings memory-mapped, as the server reads them: re-ranking is timed
    (indexer.tune) and run (measure_recall) on the path that serves it."""
    embeddings = {
        n: np.load(vdir / artifact.EMBEDDINGS / f"{n}.npy", mmap_mode="r") for n in stored.names
    }
    return StoredRows(stored.names, embeddings, stored.presence)


def exact_vectors_of(
    head: Head, stored: StoredRows, rows: np.ndarray, target: Sequence[str]
) -> ExactVectors:
    """positions -> the view's exact vectors, recomputed from the stored embeddings."""

    def vectors(positions: np.ndarray) -> np.ndarray:
        chunks = factor_chunks(head, stored, rows[positions], target, "record")
        return np.concatenate([np.zeros((0, head.factor_dim), np.float32), *chunks])

    return vectors


def build_view(
    vdir: Path,
    head: Head,
    stored: StoredRows,
    query: Sequence[str],
    spec: IndexSpec,
    tuning: tune.TuneOptions | None = None,
) -> dict[str, Any]:
    """Write the view's vectors (views/<name>.npy, flat) or index (views/<name>.faiss) and
    views/<name>.rows.npy; return the manifest entry.

    A spec with a recall target (`auto`, or the pick of an earlier tuning) runs the tuner
    (indexer.tune), with `tuning`'s options: held-out query vectors of the view's own (e.g.
    from logged requests) join those sampled from the records."""
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
    flat_path = vdir / "views" / f"{name}.npy"
    if spec.exact or spec.tuned or len(rows) == 0:
        # An aligned float32 .npy, memory-mapped by the server: FAISS's exact kernels take it
        # as it is (faiss.knn), and so do torch and numpy, which a .faiss file's 45-byte
        # header would misalign. The tuner measures on it too, and drops it if it picks an index.
        with NpyAppender(flat_path, dim) as w:
            for xb in factor_chunks(head, stored, rows, t, "record"):
                w.append(xb)
        entry["spec"] = IndexSpec("flat", {}, spec.target_recall).to_dict()
        entry["recall_at_10"] = 1.0
        if not spec.tuned or len(rows) == 0:
            return entry
        return _tuned(vdir, head, stored, q, t, rows, entry, spec, tuning or tune.TuneOptions())
    mapped = mapped_rows(vdir, stored)
    exact = exact_vectors_of(head, mapped, rows, t)
    max_norm = max(norm_of(xb) for xb in factor_chunks(head, stored, rows, t, "record"))
    width = augmented_width(dim, spec)
    index = new_index(spec, width, len(rows))
    if not index.is_trained:
        rng = np.random.default_rng(0)
        sample = np.sort(rng.choice(len(rows), size=min(len(rows), 50_000), replace=False))
        train = np.concatenate(list(factor_chunks(head, stored, rows[sample], t, "record")))
        index.train(ann.stored_form(spec, train, max_norm, width))
    for xb in factor_chunks(head, stored, rows, t, "record"):
        index.add(ann.stored_form(spec, xb, max_norm, width))
    faiss.write_index(index, str(vdir / "views" / f"{name}.faiss"))
    entry["augment"] = {"max_norm": max_norm, "width": width}
    xq = sample_queries(head, stored, q, RECALL_QUERIES, seed=1)
    chunks = factor_chunks(head, stored, rows, t, "record")
    entry["recall_at_10"] = measure_recall(xq, chunks, index, spec, max_norm, width, exact)
    log.info("view %s: %s recall@10 = %.3f", name, spec.kind, entry["recall_at_10"])
    return entry


def _tuned(
    vdir: Path,
    head: Head,
    stored: StoredRows,
    q: tuple[str, ...],
    t: tuple[str, ...],
    rows: np.ndarray,
    entry: dict[str, Any],
    spec: IndexSpec,
    opts: tune.TuneOptions,
) -> dict[str, Any]:
    """The tuner's pick for a view whose flat vectors are already written (entry says flat)."""
    assert spec.target_recall is not None
    name = view_name(q)
    flat_path = vdir / "views" / f"{name}.npy"
    sources = {"records": sample_queries(head, stored, q, 2 * TUNE_QUERIES, seed=1)}
    held_out = opts.held_out.get(name)
    if held_out is not None and len(held_out):
        sources["held_out"] = np.asarray(held_out, dtype=np.float32)
    tune_q, check_q = tune.split_queries(sources)
    vectors = np.load(flat_path, mmap_mode="c")  # as the server maps it (torch wants writable)
    work = tune.Workload(
        vectors=vectors,
        tune_q=tune_q,
        check_q=check_q,
        exact_vectors=exact_vectors_of(head, mapped_rows(vdir, stored), rows, t),
        sources={k: len(v) for k, v in sources.items()},
    )
    log.info(
        "view %s: tuning for recall@10 >= %s over %d records", name, spec.target_recall, len(rows)
    )
    result = tune.tune(work, spec.target_recall, opts)
    entry["tuning"] = result.report
    entry["spec"] = result.spec.to_dict()
    entry["recall_at_10"] = round(result.recall, 4)
    log.info("view %s: picked %s (%s)", name, result.spec, result.report.get("why", "met"))
    if result.index is None:
        return entry
    del vectors, work
    faiss.write_index(result.index, str(vdir / "views" / f"{name}.faiss"))
    flat_path.unlink()
    entry["augment"] = {"max_norm": result.max_norm, "width": result.width}
    return entry


def measure_recall(
    xq: np.ndarray,
    chunks: Iterator[np.ndarray],
    index: faiss.Index,
    spec: IndexSpec,
    max_norm: float,
    width: int,
    exact: ExactVectors,
) -> float:
    """recall@10 of the approximate index, searched as the server searches it, against exact
    search (faiss.contrib's streamed ground truth) on sampled records' queries."""
    if len(xq) == 0:
        return float("nan")
    _, truth = knn_ground_truth(xq, chunks, RECALL_K, metric_type=faiss.METRIC_INNER_PRODUCT)
    k = min(RECALL_K, index.ntotal)
    _, got = ann.search(index, spec, xq, k, max_norm, width, exact_vectors=exact)
    return round(float(knn_intersection_measure(got, np.asarray(truth)[:, :k])), 4)
