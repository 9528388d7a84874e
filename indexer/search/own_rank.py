"""Where each query's own record came in a search's results: the ranks `hclip eval --root`
gives models.metrics, from the rows a view's search returned."""

from __future__ import annotations

import numpy as np

from models.metrics import NOT_FOUND


def found_ranks(rows: np.ndarray, own: np.ndarray) -> np.ndarray:
    """(nq,) float: the 1-based position of own[i] among result rows[i] ((nq, k), -1 for a
    missing result), or NOT_FOUND when it is not among them."""
    hit = rows == own[:, None]  # (nq, k)
    position = hit.argmax(axis=1) + 1.0
    return np.where(hit.any(axis=1), position, NOT_FOUND)
