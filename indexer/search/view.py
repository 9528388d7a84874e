"""Searching one view: exact search over its memory-mapped vectors (indexer.search.exact) or
an approximate FAISS index over the norm-augmented ones (indexer.search.ann), with a filter's
allowed positions and a request's effort."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from indexer.search import ann, exact, lone_query
from indexer.search.specs import IndexSpec

EXACT_FILTERED_ROWS = 20_000  # filtered searches over this few allowed rows are exact
SUBSET_FRACTION = 0.25  # ... and so are those that keep less than this share of the rows


class Searchable(Protocol):
    """What the service needs of a view: View here, or a collection in Milvus
    (indexer.store.milvus_served.MilvusView), whose filters are expressions instead of masks."""

    name: str
    query: tuple[str, ...]
    target: tuple[str, ...]
    spec: IndexSpec
    dim: int
    vectors: np.ndarray | None
    remote: bool  # its searches wait on the network: never on an event loop

    @property
    def default_effort(self) -> int | None: ...

    def effort_used(self, effort: int | None, k: int) -> int | None: ...

    def search(
        self, xq: np.ndarray, k: int, allowed: Any = None, effort: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class View:
    """One view: its rows and either its vectors (flat: exact search, indexer.search.exact)
    or an approximate FAISS index over the norm-augmented vectors (indexer.search.mips), searched by
    indexer.search.ann (compressed codes re-ranked from exact vectors recomputed here)."""

    name: str
    query: tuple[str, ...]
    target: tuple[str, ...]
    spec: IndexSpec
    rows: np.ndarray  # position -> record row
    dim: int
    vectors: np.ndarray | None = None  # flat: (n, dim) float32, memory-mapped
    index: Any = None  # approximate: a FAISS index
    max_norm: float | None = None
    width: int | None = None
    # approximate: position -> exact vectors, recomputed from the stored embeddings
    exact_vectors: Callable[[np.ndarray], np.ndarray] | None = None
    remote: bool = False

    @property
    def count(self) -> int:
        return len(self.rows)

    def effort_used(self, effort: int | None, k: int) -> int | None:
        """The effort a search with this `effort` (None: the spec's) and k runs with."""
        return ann.effort_used(self.spec, effort, k)

    @property
    def default_effort(self) -> int | None:
        """The effort the spec searches with: HNSW's ef_search, IVF's nprobe, else None."""
        return self.spec.effort

    def search(
        self,
        xq: np.ndarray,
        k: int,
        allowed: np.ndarray | None = None,
        effort: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, record rows), both (nq, k'); k' = min(k, view size, allowed positions).
        Scores are exact inner products for every index kind; rows of -1 mark missing results
        (IVF). `allowed` (count,) bool restricts the search to those positions (a filter);
        `effort` overrides an approximate index's ef_search or nprobe."""
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        if self.vectors is not None:
            if allowed is None:
                scores, pos = lone_query.search(xq, self.vectors, k)
            else:
                scores, pos = exact.search_allowed(xq, self.vectors, k, allowed)
        else:
            scores, pos = self._approximate(xq, k, allowed, effort)
        rows = np.where(pos >= 0, np.asarray(self.rows)[np.clip(pos, 0, None)], -1)
        return scores, rows

    def _approximate(
        self, xq: np.ndarray, k: int, allowed: np.ndarray | None, effort: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        assert self.max_norm is not None and self.width is not None
        n_allowed = self.count if allowed is None else int(allowed.sum())
        k = min(k, n_allowed)
        if k == 0:
            return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
        few = n_allowed <= EXACT_FILTERED_ROWS or n_allowed <= SUBSET_FRACTION * self.count
        if allowed is not None and self.exact_vectors is not None and few:
            # A graph or list search under a selective filter runs out of allowed neighbours:
            # few allowed rows are searched exactly, from vectors recomputed for them.
            positions = np.flatnonzero(allowed)
            exact_s, exact_p = exact.search(xq, self.exact_vectors(positions), k)
            return exact_s, positions[exact_p]
        if allowed is not None and effort is None and self.default_effort is not None:
            # A filter keeping a share p of the rows leaves about p of each candidate list:
            # widen the search to keep the effort spent on allowed rows (at most 4x).
            effort = min(
                4 * self.default_effort, round(self.default_effort * self.count / n_allowed)
            )
        return ann.search(
            self.index,
            self.spec,
            xq,
            k,
            self.max_norm,
            self.width,
            effort,
            allowed,
            self.exact_vectors,
        )
