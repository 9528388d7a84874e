"""Reading a published version back for serving: the record store, the per-modality embeddings
and one index per view, all memory-mapped where the index type allows it.

Opening a version costs O(1) in its record count: the manifest is parsed, arrays' headers are
read and their shapes checked against it, and everything else is mapped, not read. Pages come
in as searches touch them; two versions open during a swap share the machine's page cache
instead of holding two resident copies.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from indexer.search.specs import FLAT_CODE_KINDS, IndexSpec, set_search_params
from indexer.search.view import View
from indexer.store import artifact, fp16_file
from indexer.store.recordstore import RecordStore, RecordStoreError, id_hash_of
from indexer.store.rows import (
    COMPACT_SUFFIX,
    StoredRows,
    embedding_path,
    factor_chunks,
    map_embeddings,
)
from models.checkpoint import fingerprint
from models.heads import build_head

log = logging.getLogger(__name__)


class LoadedVersion:
    """One published version, opened read-only for serving."""

    remote = False  # read from memory maps here (indexer.store.milvus_served: over the network)

    def __init__(self, vdir: Path, mmap: bool = True):
        self.path = vdir
        self.manifest = artifact.read_manifest(vdir)
        self.version: str = self.manifest["version"]
        self.names: list[str] = self.manifest["modalities"]
        count = int(self.manifest["counts"]["records"])
        # float16 files (a compact version's embeddings, and the views that are hard links to
        # them) opened once each: FAISS searches them and numpy reads their rows in one mapping
        self._fp16: dict[tuple[int, int], faiss.Index] = {}
        self._mmap = mmap
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

    def probe(self) -> None:
        """VersionGone when a file this version is served from is no longer under the root (its
        memory maps would go on answering, but nothing restarted could): a stat a file."""
        for rel in [artifact.MANIFEST, *self.manifest.get("files", {})]:
            if not (self.path / rel).is_file():
                raise artifact.VersionGone(
                    f"version {self.version}: {self.path / rel} is gone (the version was removed "
                    "while it served)"
                )

    def _embeddings(self, name: str, count: int) -> np.ndarray:
        path = embedding_path(self.path, name)
        rel = path.relative_to(self.path)
        want = np.float16 if is_compact(self.manifest) else np.float32
        try:
            if path.suffix == COMPACT_SUFFIX:
                fp16_file.layout(path)  # a file of another kind is named, not misread
                arr = fp16_file.rows_of(self._fp16_index(path))
            else:
                arr = map_embeddings(self.path, name)
        except fp16_file.Fp16FileError as exc:
            raise artifact.ArtifactError(str(exc)) from None
        d = int(self.manifest["d"])
        if arr.shape != (count, d) or arr.dtype != want:
            raise artifact.ArtifactError(
                f"{self.path}: {rel} holds {arr.dtype} {arr.shape}, expected "
                f"{np.dtype(want)} ({count}, {d})"
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
            path = base / f"{name}.faiss"
            if spec.kind == "fp16":  # the embeddings file itself, where the view links to it
                view.index = self._fp16_index(path)
            else:
                # flat codes stay memory-mapped, their pages shared between workers and versions
                flag = faiss.IO_FLAG_MMAP_IFC if mmap and spec.kind in FLAT_CODE_KINDS else 0
                view.index = faiss.read_index(str(path), flag)
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

    def _fp16_index(self, path: Path) -> faiss.Index:
        """A float16 file's index, read once per file (hard links are one file)."""
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key not in self._fp16:
            self._fp16[key] = fp16_file.read_index(path, mmap=self._mmap)
        return self._fp16[key]

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


def is_compact(manifest: dict[str, Any]) -> bool:
    """A compact version: float16 embeddings, product views as codes (docs/design.md §5)."""
    return bool(manifest.get("compact"))


def built_by(manifest: dict[str, Any], model_dir: Path | None, hint: str = "") -> Path:
    """The model directory that built a version (`model_dir`, else the one its manifest names),
    checked by fingerprint: another model's embeddings or queries would not match its own."""
    model_dir = model_dir or Path(manifest["model"]["path"])
    fp = fingerprint(model_dir)
    if fp != manifest["model"]["fingerprint"]:
        raise artifact.ArtifactError(
            f"model {model_dir} (fingerprint {fp}) differs from the one that built version "
            f"{manifest['version']} ({manifest['model']['fingerprint']}){hint}"
        )
    return model_dir
