"""Reading a published version back for serving: the record store, the per-modality embeddings
and one index per view, all memory-mapped where the index type allows it.

Opening a version costs O(1) in its record count: the manifest is parsed, arrays' headers are
read and their shapes checked against it, and everything else is mapped, not read. Pages come
in as searches touch them; two versions open during a swap share the machine's page cache
instead of holding two resident copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from indexer import ann, artifact, flat
from indexer.arrays import NpyRows
from indexer.recordstore import RecordStore, RecordStoreError, id_hash_of
from indexer.specs import IndexSpec, set_search_params
from indexer.views import StoredRows, factor_chunks
from models.heads import build_head

log = logging.getLogger(__name__)


def embedding_path(vdir: Path, name: str) -> Path:
    return vdir / artifact.EMBEDDINGS / f"{name}.npy"


def load_rows(vdir: Path, names: list[str], mmap: bool = True) -> StoredRows:
    """Memory-mapped for serving; plain chunked reads for build jobs (see NpyRows)."""
    embeddings: dict[str, Any] = {
        n: np.load(embedding_path(vdir, n), mmap_mode="r")
        if mmap
        else NpyRows(embedding_path(vdir, n))
        for n in names
    }
    store = RecordStore(vdir, names)
    presence = store.presence if mmap else np.array(store.presence)
    return StoredRows(names=names, embeddings=embeddings, presence=presence)


EXACT_FILTERED_ROWS = 20_000  # filtered searches over this few allowed rows are exact


@dataclass
class View:
    """One view: its rows and either its vectors (flat: exact search by indexer.flat's kernels)
    or an approximate FAISS index over the norm-augmented vectors (indexer.mips), searched by
    indexer.ann (compressed codes re-ranked from exact vectors recomputed here)."""

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
        kernel: str = "faiss",
        allowed: np.ndarray | None = None,
        effort: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, record rows), both (nq, k'); k' = min(k, view size, allowed positions).
        Scores are exact inner products for every index kind; rows of -1 mark missing results
        (IVF). `kernel` names the exact kernel of a flat view (indexer.flat.KERNELS);
        `allowed` (count,) bool restricts the search to those positions (a filter); `effort`
        overrides an approximate index's ef_search or nprobe."""
        xq = np.ascontiguousarray(xq, dtype=np.float32)
        if self.vectors is not None:
            if allowed is None:
                scores, pos = flat.search(kernel, xq, self.vectors, k)
            else:
                scores, pos = flat.search_allowed(kernel, xq, self.vectors, k, allowed)
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
        if (
            allowed is not None
            and self.exact_vectors is not None
            and (n_allowed <= EXACT_FILTERED_ROWS or n_allowed <= flat.SUBSET_FRACTION * self.count)
        ):
            # A graph or list search under a selective filter runs out of allowed neighbours:
            # few allowed rows are searched exactly, from vectors recomputed for them.
            positions = np.flatnonzero(allowed)
            exact_s, exact_p = flat.search("faiss", xq, self.exact_vectors(positions), k)
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


class LoadedVersion:
    """One published version, opened read-only for serving."""

    def __init__(self, vdir: Path, mmap: bool = True):
        self.path = vdir
        self.manifest = artifact.read_manifest(vdir)
        self.version: str = self.manifest["version"]
        self.names: list[str] = self.manifest["modalities"]
        count = int(self.manifest["counts"]["records"])
        try:
            fields = self.manifest.get("filter_fields")
            self.records = RecordStore(vdir, self.names, fields, id_hash_of(self.manifest))
        except RecordStoreError as exc:
            raise artifact.ArtifactError(str(exc)) from None
        if len(self.records) != count:
            raise artifact.ArtifactError(
                f"{vdir}: the record store holds {len(self.records)} rows, the manifest {count}"
            )
        self.stored = StoredRows(
            names=self.names,
            embeddings={n: self._embeddings(n, count) for n in self.names},
            presence=self.records.presence,
        )
        cfg = self.manifest["model"]["config"]
        # Record factors are parameter-free for every head: no weights needed to recompute.
        self.head = build_head(cfg["head"], self.names, cfg["latent_dim"])
        self.views: dict[str, View] = {}
        for name, entry in self.manifest["views"].items():
            self.views[name] = self._open_view(name, entry, mmap)

    def _embeddings(self, name: str, count: int) -> np.ndarray:
        arr = np.load(embedding_path(self.path, name), mmap_mode="r")
        d = int(self.manifest["d"])
        if arr.shape != (count, d):
            raise artifact.ArtifactError(
                f"{self.path}: embeddings/{name}.npy has shape {arr.shape}, expected ({count}, {d})"
            )
        return arr

    def _open_view(self, name: str, entry: dict[str, Any], mmap: bool) -> View:
        spec = IndexSpec.from_dict(entry["spec"])
        base = self.path / artifact.VIEWS
        rows = np.load(base / f"{name}.rows.npy", mmap_mode="r")
        dim, count = int(entry["dim"]), int(entry["count"])
        view = View(name, tuple(entry["query"]), tuple(entry["target"]), spec, rows, dim)
        if spec.exact:
            # Copy-on-write keeps the map shareable and lets torch wrap it without a copy (it
            # refuses read-only arrays); nothing ever writes to it.
            view.vectors = np.load(base / f"{name}.npy", mmap_mode="c" if mmap else None)
            held = view.vectors.shape
        else:
            view.index = faiss.read_index(str(base / f"{name}.faiss"))
            set_search_params(view.index, spec)
            view.max_norm = float(entry["augment"]["max_norm"])
            view.width = int(entry["augment"]["width"])
            view.exact_vectors = partial(self._record_factors, view)
            held = (view.index.ntotal, dim)
        if held != (count, dim) or len(rows) != count:
            raise artifact.ArtifactError(
                f"{self.path}: view {name}: holds {held}, rows file {len(rows)}, manifest "
                f"({count}, {dim})"
            )
        return view

    def _record_factors(self, view: View, positions: np.ndarray) -> np.ndarray:
        """The exact vectors of a view's positions, from the stored embeddings."""
        rows = np.asarray(view.rows)[positions]
        chunks = factor_chunks(self.head, self.stored, rows, view.target, "record")
        return np.concatenate([np.zeros((0, view.dim), np.float32), *chunks])

    def mask_of(self, view: View, flt: dict[str, Any]) -> np.ndarray:
        """(view count,) bool: the view's positions whose records pass the filter."""
        return self.records.fields.evaluate(flt, len(self.records))[np.asarray(view.rows)]

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["model"]["fingerprint"])

    def embeddings_of(self, row: int) -> dict[str, list[float]]:
        return {
            n: np.asarray(self.stored.embeddings[n][row]).tolist()
            for n in self.records.modalities(row)
        }
