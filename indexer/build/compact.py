"""Compact versions (docs/design.md §5, "Compact versions"): the staged float32 embeddings
become float16 files that FAISS searches as they are (indexer.store.fp16_file), and every view
is stored as codes or float16, never as float32 vectors.

- A view whose record factor is one modality's embedding as it is (H-CLIP's and Symile's views
  that query all modalities but one) searches the float16 embeddings exactly: a hard link to
  embeddings/<modality>.faiss when every record has that modality, else a float16 file of its
  own rows (`"stores": "float16"`).
- Any other view (a product of embeddings, or a sum-of-pairs factor) is stored only as FAISS
  codes, `sq8` by default (8-bit scalar codes, a flat scan), or `ivfsq` / `ivfpq`, and every
  search re-ranks its best k * rerank candidates exactly from the float16 embeddings
  (indexer.search.ann.rerank; `"stores": "codes:SQ8"`).

The codes follow a fixed rule: `sq8:rerank=10` unless --spec names other codes. With
`auto[:recall=R]`, the tuner (indexer.tune) measures inverted files of codes (IVF-SQ8, IVF-PQ,
re-ranked exactly) against flat search as for a full version, and keeps the fastest that holds
R; where none is fast enough, the view is sq8 with its re-ranking depth measured for R. Under
`auto` the views over one modality's embeddings are measured too, with IVF-PQ codes only
(EMBEDDING_FAMILIES), and keep the exact float16 scan where none is fast enough. At
a quarter of float32's bytes it kept recall@10 at 0.998 to 1.000 against float32 exact search
through the API (benchmarks/bench_compact.py, 20k records x 3 x 128); each build measures and
records the recall it gets (`recall_at_10`), as for any approximate view.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from faiss.contrib.exhaustive_search import knn_ground_truth

from indexer.build.options import JobOptions
from indexer.build.views import RECALL_QUERIES, build_view, sample_queries
from indexer.search.mips import max_norm as norm_of
from indexer.search.specs import IndexSpec, SpecError
from indexer.store import artifact
from indexer.store.arrays import NpyRows
from indexer.store.fp16_file import Fp16Appender
from indexer.store.rows import (
    CHUNK,
    StoredRows,
    compact_embedding_path,
    exact_vectors_of,
    factor_chunks,
    mapped_rows,
)
from indexer.tune import rerank_depth
from indexer.tune.tuner import TuneOptions
from models.heads import Head, split_modalities, view_name

log = logging.getLogger(__name__)

DEFAULT_CODES = IndexSpec("sq8", {"rerank": 10})
CODE_KINDS = ("sq8", "ivfsq", "ivfpq")  # kinds that store codes and re-rank exactly
# What `auto` measures on a compact version's views: inverted files of codes. On the product
# views, IVF-SQ8 (a byte a dimension) or IVF-PQ (4-bit codes, a quarter byte a dimension).
TUNING = TuneOptions(families=("ivfsq", "ivfpq"))
# On a view that searches one modality's float16 embeddings, codes come on top of them (the
# re-ranking reads the embeddings), so only IVF-PQ's, an eighth of the float16 bytes: IVF-SQ8's
# would add half of them again. Where none serves MIN_SPEEDUP times float32 flat search, the
# view scans the float16 embeddings exactly.
EMBEDDING_FAMILIES = ("ivfpq",)
STORES = {"sq8": "codes:SQ8", "ivfsq": "codes:IVF-SQ8", "ivfpq": "codes:IVF-PQ", "fp16": "float16"}


def codes_spec(spec: IndexSpec) -> IndexSpec:
    """The spec of a compact version's product views: `flat` (the default) means sq8 with its
    default re-ranking depth; `auto[:recall=R,batch=B]` (or codes picked for R before, or a
    flat view kept for R: an update measures again) the tuner's pick for R among codes; a
    kind that would store float32 vectors is refused."""
    if spec.exact and not spec.tuned:
        return DEFAULT_CODES
    if spec.tuned and spec.kind in ("auto", "flat", *CODE_KINDS):
        batch = spec.params.get("batch") if spec.kind == "auto" else None
        return IndexSpec("auto", {"batch": batch} if batch else {}, spec.target_recall)
    if spec.kind in CODE_KINDS and not spec.tuned:
        if not spec.params.get("rerank"):
            raise SpecError(f"--compact: --spec {spec} must re-rank (rerank=R with R >= 1)")
        return spec
    raise SpecError(
        f"--compact: --spec {spec.kind} is not supported (it would store float32 vectors); use "
        "sq8[:rerank=R] (the default), auto[:recall=R] (codes picked for R), ivfsq[...] "
        "or ivfpq[...]"
    )


def check_options(opts: JobOptions, milvus: bool = False) -> None:
    """One line naming the option for what a compact job cannot do; `milvus`: the views
    would go to Milvus (--backend milvus, or the root's backend)."""
    if not opts.compact:
        return
    if milvus or opts.backend == "milvus":
        raise SpecError(
            "--compact: not supported with --backend milvus (Milvus keeps its own copy of "
            "every vector); build a compact version on the faiss backend"
        )
    opts.spec = codes_spec(opts.spec)


def halve_embeddings(stage: Path, names: Sequence[str]) -> None:
    """Each staged embeddings/<m>.npy (float32) rewritten as embeddings/<m>.faiss (float16,
    rounded to nearest), a chunk at a time; the float32 file is removed."""
    for name in names:
        src = stage / artifact.EMBEDDINGS / f"{name}.npy"
        rows = NpyRows(src)
        with Fp16Appender(compact_embedding_path(stage, name), rows.shape[1]) as out:
            for start in range(0, rows.shape[0], CHUNK):
                out.append(rows[np.arange(start, min(start + CHUNK, rows.shape[0]))])
        src.unlink()


def build_views(
    stage: Path, head: Head, stored: StoredRows, queries: Sequence[Sequence[str]], spec: IndexSpec
) -> list[dict[str, Any]]:
    """Every view's manifest entry, in order, each with what it `stores`."""
    entries = []
    for query in queries:
        q, t = split_modalities(head.names, query)
        rows = stored.rows_with(t)
        if len(rows) == 0:
            entry = _float16_view(stage, head, stored, q, t, rows)
        elif _is_embedding(head, stored, rows, t):
            if spec.kind == "auto":
                entry = _tuned_embedding_codes(stage, head, stored, q, t, rows, spec)
            else:
                entry = _float16_view(stage, head, stored, q, t, rows)
        elif spec.kind == "auto":
            entry = _tuned_codes(stage, head, stored, q, spec)
        else:
            entry = build_view(stage, head, stored, q, spec)
            entry["stores"] = STORES[spec.kind]
        log.info("view %s stores %s", view_name(q), entry["stores"])
        narrow_rows(stage / artifact.VIEWS / f"{view_name(q)}.rows.npy")
        entries.append(entry)
    return entries


def narrow_rows(path: Path) -> None:
    """A view's rows file as int32 where every row fits (fewer than 2**31 records): half the
    bytes of int64, read the same (docs/design.md §5)."""
    rows = np.load(path)
    if rows.dtype != np.int32 and (rows.size == 0 or int(rows.max()) < 2**31):
        np.save(path, rows.astype(np.int32))


def _is_embedding(head: Head, stored: StoredRows, rows: np.ndarray, t: tuple[str, ...]) -> bool:
    """The head's record factor of these rows is one modality's embeddings as they are (the
    head's algebra, shown on the first chunk: it holds for every row or none)."""
    if len(t) != 1 or head.factor_dim != stored.embeddings[t[0]].shape[1]:
        return False
    first = rows[:CHUNK]
    factor = next(factor_chunks(head, stored, first, t, "record"))
    return bool(np.array_equal(factor, np.asarray(stored.embeddings[t[0]][first], np.float32)))


def _float16_view(
    stage: Path,
    head: Head,
    stored: StoredRows,
    q: tuple[str, ...],
    t: tuple[str, ...],
    rows: np.ndarray,
) -> dict[str, Any]:
    """A view searched exactly over float16 rows: the embeddings file itself (a hard link)
    when the view holds every record, else a file of its own rows' float16 factors."""
    name = view_name(q)
    np.save(stage / artifact.VIEWS / f"{name}.rows.npy", rows)
    path = stage / artifact.VIEWS / f"{name}.faiss"
    if len(rows) and len(rows) == stored.count:
        os.link(compact_embedding_path(stage, t[0]), path)
    else:
        with Fp16Appender(path, head.factor_dim) as out:
            for xb in factor_chunks(head, stored, rows, t, "record"):
                out.append(xb)  # float16 values widened, so narrowed back exactly
    chunks = factor_chunks(head, stored, rows, t, "record")
    norm = max((norm_of(xb) for xb in chunks), default=0.0)
    return {
        "query": list(q),
        "target": list(t),
        "count": len(rows),
        "dim": head.factor_dim,
        "spec": IndexSpec("fp16").to_dict(),
        "recall_at_10": 1.0,
        "augment": {"max_norm": norm, "width": head.factor_dim},
        "stores": STORES["fp16"],
    }


def _tuning(spec: IndexSpec, families: Sequence[str] | None = None) -> TuneOptions:
    tuning = TUNING if families is None else replace(TUNING, families=families)
    if spec.params.get("batch"):
        tuning = replace(tuning, served_batch=int(spec.params["batch"]))
    return tuning


def _codes_picked(stage: Path, q: tuple[str, ...], entry: dict[str, Any]) -> bool:
    """Whether the tuner kept codes; if not, the float32 vectors it measured on are dropped."""
    picked = IndexSpec.from_dict(entry["spec"])
    if picked.kind in CODE_KINDS:
        entry["stores"] = STORES[picked.kind]
        return True
    (stage / artifact.VIEWS / f"{view_name(q)}.npy").unlink(missing_ok=True)
    return False


def _tuned_codes(
    stage: Path, head: Head, stored: StoredRows, q: tuple[str, ...], spec: IndexSpec
) -> dict[str, Any]:
    """The tuner's pick among inverted files of codes (the float32 vectors it measures flat
    search on are dropped); where none serves MIN_SPEEDUP times flat search at the target,
    sq8 with its depth chosen for the target."""
    assert spec.target_recall is not None
    entry = build_view(stage, head, stored, q, spec, _tuning(spec))
    if _codes_picked(stage, q, entry):
        return entry
    return _sq8_at_depth(stage, head, stored, q, spec.target_recall, entry.get("tuning"))


def _tuned_embedding_codes(
    stage: Path,
    head: Head,
    stored: StoredRows,
    q: tuple[str, ...],
    t: tuple[str, ...],
    rows: np.ndarray,
    spec: IndexSpec,
) -> dict[str, Any]:
    """A view over one modality's embeddings under `auto`: the tuner's inverted file of PQ
    codes, re-ranked exactly from the float16 embeddings, where one serves MIN_SPEEDUP times
    flat search at the target; else the exact float16 scan, with the tuner's report."""
    entry = build_view(stage, head, stored, q, spec, _tuning(spec, EMBEDDING_FAMILIES))
    if _codes_picked(stage, q, entry):
        return entry
    exact = _float16_view(stage, head, stored, q, t, rows)
    if "tuning" in entry:
        exact["tuning"] = {"inverted_files": entry["tuning"]}
    return exact


def _sq8_at_depth(
    stage: Path,
    head: Head,
    stored: StoredRows,
    q: tuple[str, ...],
    target: float,
    tuner_report: dict[str, Any] | None,
) -> dict[str, Any]:
    """An sq8 view whose re-ranking depth is the smallest that keeps recall@10 >= target on
    sampled queries (indexer.tune.rerank_depth), checked on others; `tuner_report`: why no
    inverted file was picked."""
    deepest = IndexSpec("sq8", {"rerank": rerank_depth.DEPTHS[-1]})
    entry = build_view(stage, head, stored, q, deepest)  # the codes are the same at any depth
    _, t = split_modalities(head.names, q)
    rows = stored.rows_with(t)
    index = faiss.read_index(str(stage / artifact.VIEWS / f"{view_name(q)}.faiss"))
    queries = sample_queries(head, stored, q, 2 * RECALL_QUERIES, seed=1)
    tune_q, check_q = queries[0::2], queries[1::2]

    def truth_of(xq: np.ndarray) -> np.ndarray:
        chunks = factor_chunks(head, stored, rows, t, "record")
        _, idx = knn_ground_truth(xq, chunks, rerank_depth.K, faiss.METRIC_INNER_PRODUCT)
        return np.asarray(idx)

    exact = exact_vectors_of(head, mapped_rows(stage, stored), rows, t)
    choice = rerank_depth.choose_depth(index, "sq8", tune_q, check_q, truth_of, exact, target)
    entry["spec"] = IndexSpec("sq8", {"rerank": choice.depth}, target).to_dict()
    entry["recall_at_10"] = round(choice.recall, 4)
    entry["tuning"] = choice.report(target)
    if tuner_report is not None:
        entry["tuning"]["inverted_files"] = tuner_report
    entry["stores"] = STORES["sq8"]
    log.info("view %s: sq8 re-ranked %d deep: recall@10 %.3f (target %s)",
             view_name(q), choice.depth, choice.recall, target)  # fmt: skip
    return entry


def manifest_block(spec: IndexSpec) -> dict[str, Any]:
    """The manifest's `compact`: what the embeddings and the product views store (with `auto`,
    each view's spec has its own depth)."""
    if spec.kind == "auto":
        return {"embeddings": "float16", "codes": f"auto:recall={spec.target_recall}",
                "rerank": None}  # fmt: skip
    return {"embeddings": "float16", "codes": str(spec), "rerank": int(spec.params["rerank"])}
