"""The re-ranking depth of a view of codes for a recall target (`--compact --spec
auto[:recall=R]`, indexer.build.compact): the smallest R in DEPTHS whose best k * R candidates,
re-ranked exactly, hold recall@10 >= target on one half of the sampled queries by one standard
error (as the tuner's sweeps do: a depth that meets the target on those queries only just
missed it on held-out ones); the recall reported is the other half's, which played no part in
the choice.

Only the depth is chosen: the codes (sq8) are the same for every depth, and a deeper re-ranking
costs only the exact scores of more candidates, so the smallest depth that keeps the target is
the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from indexer.search import ann
from indexer.search.ann import ExactVectors
from indexer.search.specs import IndexSpec
from indexer.tune.tuner import recall_of

DEPTHS = (1, 2, 4, 8, 16, 32, 64)
K = 10


@dataclass
class DepthChoice:
    depth: int
    recall: float  # on the check half, at `depth`
    met: bool  # the tune half reached the target at `depth` (else the deepest was kept)
    tried: dict[int, float] = field(default_factory=dict)  # depth -> the tune half's recall
    se: dict[int, float] = field(default_factory=dict)  # depth -> that recall's standard error

    def report(self, target: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target_recall": target,
            "picked": {"rerank": self.depth},
            "tried": {str(d): round(r, 4) for d, r in self.tried.items()},
            "tried_se": {str(d): round(e, 4) for d, e in self.se.items()},
            "check": {"recall": round(self.recall, 4)},
        }
        if not self.met:
            out["why"] = f"no depth up to {DEPTHS[-1]} reached recall@10 {target}: kept the deepest"
        return out


def choose_depth(
    index: Any,
    kind: str,
    tune_q: np.ndarray,
    check_q: np.ndarray,
    truth_of: Callable[[np.ndarray], np.ndarray],
    exact_vectors: ExactVectors,
    target: float,
) -> DepthChoice:
    """The smallest depth of DEPTHS reaching `target` on tune_q; `truth_of(xq)` gives each
    query's exact top-K positions."""
    width = index.d
    k = min(K, index.ntotal)

    def recall(xq: np.ndarray, truth: np.ndarray, depth: int) -> tuple[float, float]:
        spec = IndexSpec(kind, {"rerank": depth})
        _, found = ann.search(index, spec, xq, k, 0.0, width, exact_vectors=exact_vectors)
        return recall_of(found, truth[:, :k])

    tune_truth, check_truth = truth_of(tune_q), truth_of(check_q)
    tried: dict[int, float] = {}
    se: dict[int, float] = {}
    for depth in DEPTHS:
        tried[depth], se[depth] = recall(tune_q, tune_truth, depth)
        if tried[depth] - se[depth] >= target:
            return DepthChoice(depth, recall(check_q, check_truth, depth)[0], True, tried, se)
    depth = DEPTHS[-1]
    return DepthChoice(depth, recall(check_q, check_truth, depth)[0], False, tried, se)
