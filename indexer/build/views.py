"""View vectors (docs/design.md §1, §4) from stored embeddings, an index per view, and recall.

A view queries with modalities Q and retrieves records by the product of their T = not-Q
modalities. Its record vectors are the head's record factor over T, computed from the stored
per-modality embeddings in chunks; only records that have every modality of T belong to it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from faiss.contrib.evaluation import knn_intersection_measure
from faiss.contrib.exhaustive_search import knn_ground_truth

from indexer.search import ann
from indexer.search.ann import ExactVectors
from indexer.search.mips import max_norm as norm_of
from indexer.search.specs import IndexSpec, augmented_width, new_index
from indexer.store.arrays import NpyAppender
from indexer.store.rows import CHUNK, StoredRows, exact_vectors_of, factor_chunks, mapped_rows
from indexer.tune import tuner as tune
from models.heads import Head, split_modalities, view_name

log = logging.getLogger(__name__)

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
        entry |= flat_entry(spec)
        if not spec.tuned or len(rows) == 0:
            return entry
        opts = tuning or tune.TuneOptions()
        if "batch" in spec.params:  # auto:batch=B: the batch the server forms under load
            opts = replace(opts, served_batch=spec.params["batch"])
        return _tuned(vdir, head, stored, q, t, rows, entry, spec, opts)
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


def flat_entry(spec: IndexSpec) -> dict[str, Any]:
    """What the manifest says of a view whose flat vectors are written (an exact view, or a
    tuned one before the tuner picks)."""
    return {"spec": IndexSpec("flat", {}, spec.target_recall).to_dict(), "recall_at_10": 1.0}


class FlatViewsWriter:
    """Exact views written while the rows are: each batch of rows' record factors, computed
    from the embeddings just encoded (in memory, not read back from the files), appended to
    views/<name>.npy, so that no pass over the stored embeddings is left for after encoding.

    The vectors are those build_view writes (the head's record factor of the same
    embeddings; only rows that have every target modality), in the same row order.

    A view whose vectors are one modality's stored embeddings as they are (H-CLIP's views
    that query all modalities but one, when every record has that one) is not written twice:
    its file becomes a hard link to embeddings/<modality>.npy, the same bytes. Should a batch
    break that (a record without the modality), the view is written out from then on, its
    earlier rows copied from the embeddings file.
    """

    def __init__(self, vdir: Path, head: Head, queries: Sequence[Sequence[str]], spec: IndexSpec):
        assert spec.exact and not spec.tuned
        self.vdir = vdir
        self.head = head
        self.spec = spec
        self.views = [split_modalities(head.names, q) for q in queries]
        self.columns = [[list(head.names).index(n) for n in t] for _, t in self.views]
        self.files: list[NpyAppender | None] = [None] * len(self.views)
        self.rows: list[list[np.ndarray]] = [[] for _ in self.views]
        self.seen = 0
        self.embedding_files: Mapping[str, NpyAppender] = {}  # set by the rows' writer

    def _path(self, k: int) -> Path:
        return self.vdir / "views" / f"{view_name(self.views[k][0])}.npy"

    def _linked(self, k: int) -> bool:
        """Still a candidate for a link: no vector of it written to a file of its own."""
        t = self.views[k][1]
        return self.files[k] is None and len(t) == 1 and t[0] in self.embedding_files

    def _file(self, k: int) -> NpyAppender:
        """The view's own file, opened on first need; rows already seen (kept as a link so
        far) are copied into it from the embeddings file, a chunk at a time."""
        f = self.files[k]
        if f is not None:
            return f
        f = self.files[k] = NpyAppender(self._path(k), self.head.factor_dim)
        t = self.views[k][1]
        if self.seen and t[0] in self.embedding_files:
            src = self.embedding_files[t[0]]
            for start in range(0, self.seen, CHUNK):
                f.append(src.read(start, min(start + CHUNK, self.seen)))
        return f

    @torch.no_grad()
    def append(self, embs: Mapping[str, np.ndarray], presence: np.ndarray) -> None:
        """Rows `seen`.. of the version: (n, d) embeddings per modality and (n, m) presence."""
        n = presence.shape[0]
        for k, ((_, t), cols) in enumerate(zip(self.views, self.columns, strict=True)):
            have = presence[:, cols].all(axis=1)
            everyone = bool(have.all())
            idx = np.flatnonzero(have)
            x = {m: torch.from_numpy(embs[m] if everyone else embs[m][idx]) for m in t}
            out = self.head.record_factor(x, t).numpy()
            self.rows[k].append(idx + self.seen)
            if self._linked(k) and everyone and np.array_equal(out, embs[t[0]]):
                continue
            self._file(k).append(out)
        self.seen += n

    def close(self) -> None:
        for f in self.files:
            if f is not None:
                f.close()

    def finish(self) -> list[dict[str, Any]]:
        """Close the files, link the views that are stored embeddings, write each view's
        rows; the manifest entries, in order. The embeddings files must be closed."""
        self.close()
        entries = []
        for k, ((q, t), rows) in enumerate(zip(self.views, self.rows, strict=True)):
            if self._linked(k) and self.seen:
                os.link(self.embedding_files[t[0]].path, self._path(k))
            elif self.files[k] is None:
                self._file(k).close()  # no row yet: an empty view
            all_rows = np.concatenate([np.zeros(0, np.int64), *rows]).astype(np.int64)
            np.save(self.vdir / "views" / f"{view_name(q)}.rows.npy", all_rows)
            entry = {"query": list(q), "target": list(t), "count": len(all_rows)}
            entries.append({**entry, "dim": self.head.factor_dim, **flat_entry(self.spec)})
        return entries


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
