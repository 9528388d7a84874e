"""Searching an approximate index: the one path the server (indexer.search.view.View) and the tuner
(indexer.tune) both take, so that what the tuner measures is what the server runs.

An approximate index holds norm-augmented vectors (indexer.search.mips), or for `ivfip` the raw
products under inner product. HNSW and IVF-Flat hold them exactly, so their distances give
exact inner products back. Compressed codes (IVF-PQ,
IVF-SQ) do not: their best `k * rerank` candidates are re-scored from exact vectors, which the
caller recomputes from the version's stored embeddings (View.exact_vectors), and the best k
of those are returned with their exact scores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from indexer.search import exact, flat_codes, mips
from indexer.search.specs import INNER_PRODUCT_KINDS, IndexSpec, search_params

ExactVectors = Callable[[np.ndarray], np.ndarray]  # positions (n,) -> (n, dim) float32


def stored_form(spec: IndexSpec, x: np.ndarray, max_norm: float, width: int) -> np.ndarray:
    """What the index of `spec` holds for record vectors x: augmented, or x as it is."""
    if spec.kind in INNER_PRODUCT_KINDS:
        return np.ascontiguousarray(x, dtype=np.float32)
    return mips.augment(x, max_norm, width)


_rerank_factor = 0  # 0: each spec's own re-ranking depth


def use_rerank_factor(factor: int) -> None:
    """Every view of re-ranked codes fetches `factor` candidates per result (process-wide;
    HCLIP_RERANK_FACTOR in the service); 0: each spec's own `rerank`."""
    global _rerank_factor
    if factor < 0:
        raise ValueError(f"rerank factor must be 0 or more, got {factor}")
    _rerank_factor = factor


def rerank_depth(spec: IndexSpec) -> int:
    """How many candidates per result the index returns for exact re-scoring (0: none): the
    process's rerank factor where one is set and the spec re-ranks, else the spec's."""
    depth = int(spec.params.get("rerank", 0))
    return _rerank_factor if depth and _rerank_factor else depth


def effort_used(spec: IndexSpec, effort: int | None, k: int) -> int | None:
    """The effort a search runs with: the one asked for, else the spec's. HNSW never searches
    with ef_search below k: FAISS would then return fewer than k results."""
    effort = effort or spec.effort
    if spec.kind == "hnsw" and effort is not None:
        return max(effort, k)
    return effort


def search(
    index: Any,
    spec: IndexSpec,
    xq: np.ndarray,
    k: int,
    max_norm: float,
    width: int,
    effort: int | None = None,
    allowed: np.ndarray | None = None,
    exact_vectors: ExactVectors | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, positions), (nq, k), best first; positions of -1 (score -inf) where the index
    found fewer than k. `effort` overrides the spec's ef_search or nprobe for this call."""
    depth = rerank_depth(spec) if exact_vectors is not None else 0
    fetch = k * depth if depth else k
    if spec.kind == "hnsw" and effort_used(spec, effort, k) != spec.effort:
        effort = effort_used(spec, effort, k)  # else the index's own ef_search is the one
    batched = None
    if allowed is None and len(xq) >= exact.blas_from():  # flat codes: read once for the batch
        batched = flat_codes.batch_search(index, xq, fetch)
    if batched is not None:
        dist, pos = batched
    else:
        params = search_params(index, spec, effort, allowed)
        dist, pos = index.search(mips.pad_queries(xq, width), fetch, params=params)
    if not depth:  # rerank=1 still re-scores: a compact version's scores are always exact
        ip = spec.kind in INNER_PRODUCT_KINDS
        scores = dist if ip else mips.inner_products(xq, dist, max_norm)
        return np.where(pos >= 0, scores, -np.inf).astype(np.float32), pos
    assert exact_vectors is not None
    return rerank(xq, pos, k, exact_vectors)


def rerank(
    xq: np.ndarray, candidates: np.ndarray, k: int, exact_vectors: ExactVectors
) -> tuple[np.ndarray, np.ndarray]:
    """The best k of each query's candidates (nq, c) by exact inner product. Each distinct
    candidate's vector is recomputed once for the whole batch."""
    valid = candidates >= 0
    uniq, inverse = np.unique(candidates[valid], return_inverse=True)
    vecs = exact_vectors(uniq) if len(uniq) else np.zeros((0, xq.shape[1]), np.float32)
    slot = np.zeros(candidates.shape, dtype=np.int64)
    slot[valid] = inverse
    scores = np.einsum("qd,qcd->qc", xq, vecs[slot]) if len(uniq) else np.zeros(slot.shape)
    scores = np.where(valid, scores, -np.inf)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    top_s = np.take_along_axis(scores, order, 1).astype(np.float32)
    top_p = np.where(np.isfinite(top_s), np.take_along_axis(candidates, order, 1), -1)
    return top_s, top_p
