"""The reduction of maximum inner product search to nearest-neighbour search, for approximate
indexes (the one home of this idea; specs, views and the reader use it).

Stored H-CLIP vectors are Hadamard products and not unit length, so graph and IVF indexes built
for cosine lose recall on them. Approximate indexes therefore store [x ; sqrt(M^2 - |x|^2)]
(M the largest norm) under L2 and search with [q ; 0]: then
|q' - x'|^2 = |q|^2 + M^2 - 2 <q, x>, so the L2 nearest neighbour is the largest inner product,
and the score is recovered exactly as (|q|^2 + M^2 - dist) / 2.

One kind measured to do better without it, `ivfip` (indexer.search.specs), indexes the raw products
under inner product instead; indexer.search.ann.stored_form says which form an index holds.
"""

from __future__ import annotations

import numpy as np


def max_norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.einsum("ij,ij->i", x, x).max())) if len(x) else 0.0


def augment(x: np.ndarray, norm: float, width: int) -> np.ndarray:
    """[x ; sqrt(M^2 - |x|^2) ; 0 ...] padded to `width` columns (float32)."""
    sq = np.einsum("ij,ij->i", x, x)
    out = np.zeros((x.shape[0], width), dtype=np.float32)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1]] = np.sqrt(np.maximum(norm**2 - sq, 0.0))
    return out


def pad_queries(xq: np.ndarray, width: int) -> np.ndarray:
    """[q ; 0 ...]: the query side of the reduction."""
    out = np.zeros((xq.shape[0], width), dtype=np.float32)
    out[:, : xq.shape[1]] = xq
    return out


def inner_products(xq: np.ndarray, dist: np.ndarray, norm: float) -> np.ndarray:
    """The inner products behind L2 distances of the reduction: (|q|^2 + M^2 - dist) / 2."""
    qn = np.einsum("ij,ij->i", xq, xq)[:, None]
    return ((qn + norm**2 - dist) / 2.0).astype(np.float32)
