"""Ranking metrics: the project's one implementation of hit@k, recall@k, MRR and median rank.

Everything starts from ranks: a query's rank is the 1-based position of the first relevant
candidate when the candidates are sorted by score, counting only the irrelevant candidates that
score strictly above it (a tie goes to the relevant one). A query whose relevant candidate was
not found (past a search's depth, or none relevant) has rank `inf`. With one relevant candidate
per query (a record's own tuple), recall@k is hit@k.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

NOT_FOUND = float("inf")


def first_relevant_rank(scores: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """(Nq,) float ranks from (Nq, G) scores and a (Nq, G) bool relevance matrix."""
    best = scores.masked_fill(~relevant, float("-inf")).max(dim=1).values  # (Nq,)
    above = ((scores > best[:, None]) & ~relevant).sum(dim=1)  # (Nq,)
    ranks = 1.0 + above.to(torch.float64)
    return torch.where(relevant.any(dim=1), ranks, torch.full_like(ranks, NOT_FOUND))


def own_rank(scores: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """(Nq,) float ranks of candidate own[i] in row i of (Nq, G) scores: one relevant each."""
    positive = scores.gather(1, own[:, None])  # (Nq, 1)
    return 1.0 + (scores > positive).sum(dim=1).to(torch.float64)


def hit_at(ranks: np.ndarray, k: int) -> float:
    """The share of queries with a relevant candidate in the top k."""
    return float(np.mean(np.asarray(ranks) <= k))


def summarize(
    ranks: np.ndarray, candidates: np.ndarray | float, ks: Iterable[int] = (10,)
) -> dict[str, Any]:
    """hit@1, recall@k for each k, MRR, median rank, and chance beside them: a random ranking
    of `candidates` per query (one number, or one per query) puts the positive first with
    probability 1/N and in the top k with probability k/N. A median past a search's depth is
    None (JSON has no infinity)."""
    r = np.asarray(ranks, dtype=np.float64)
    n = np.broadcast_to(np.asarray(candidates, dtype=np.float64), r.shape)
    median = float(np.median(r)) if len(r) else float("nan")
    out: dict[str, Any] = {"hit@1": hit_at(r, 1)}
    for k in ks:
        out[f"recall@{k}"] = hit_at(r, k)
    out["mrr"] = float(np.mean(1.0 / r))
    out["median_rank"] = median if np.isfinite(median) else None
    out["chance@1"] = float(np.mean(1.0 / n))
    for k in ks:
        out[f"chance@{k}"] = float(np.mean(np.minimum(k, n) / n))
    out["n"] = len(r)
    return out
