"""Held-out retrieval with a model's own head: each record's own tuple is the positive.

For a view (query set Q, target set T = the rest) query i's candidates are the T parts of the
records in its block (`candidates` consecutive records; all of them by default), and its rank is
that of record i's own T part among them, scored by the head's two factors (docs/design.md §1),
so an H-CLIP, Symile, sum-of-pairs or CLIP model is evaluated the same way. Training's
validation (models.train.validation) and `hclip eval` without an index both come here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations
from typing import Any

import numpy as np
import torch

from models.heads import Head, split_modalities, view_name
from models.metrics import own_rank, summarize

QUERY_CHUNK = 1024  # queries scored at once: (chunk, candidates) floats in memory


def all_views(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every non-empty proper subset of the modalities, as a query set, smallest first."""
    names = sorted(names)
    return [q for size in range(1, len(names)) for q in combinations(names, size)]


@torch.no_grad()
def view_ranks(
    head: Head,
    embs: Mapping[str, torch.Tensor],
    query: Sequence[str],
    candidates: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, candidates per query), both (N,), for the view that queries with `query`;
    embs[name] is (N, d) for every modality, row i being record i."""
    q, t = split_modalities(head.names, query)
    qf = head.query_factor(embs, q).float()  # (N, D)
    rf = head.record_factor(embs, t).float()  # (N, D)
    n = qf.shape[0]
    block = n if candidates is None else min(candidates, n)
    ranks, sizes = [], []
    for start in range(0, n, block):
        stop = min(start + block, n)
        for lo in range(start, stop, QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, stop)
            scores = qf[lo:hi] @ rf[start:stop].T  # (chunk, block)
            own = torch.arange(lo - start, hi - start, device=scores.device)
            ranks.append(own_rank(scores, own).cpu())
            sizes.append(torch.full((hi - lo,), float(stop - start), dtype=torch.float64))
    return torch.cat(ranks).numpy(), torch.cat(sizes).numpy()


def retrieval(
    head: Head,
    embs: Mapping[str, torch.Tensor],
    views: Iterable[Sequence[str]],
    candidates: int | None = None,
    ks: Sequence[int] = (10,),
) -> dict[str, dict[str, Any]]:
    """models.metrics.summarize per view, keyed by view name."""
    out = {}
    for query in views:
        ranks, sizes = view_ranks(head, embs, query, candidates)
        out[view_name(query)] = summarize(ranks, sizes, ks)
    return out


def mean_hit1(figures: Mapping[str, Mapping[str, Any]]) -> float:
    """The mean over views of hit@1: what `train.keep: best` maximises."""
    return float(np.mean([f["hit@1"] for f in figures.values()]))
