"""A version on the milvus backend opened for serving (docs/milvus.md): its views searched in
their collections, its records and stored embeddings read from the records collection, the
client's calls bounded by a deadline; and `hclip index verify`'s check of the collections
against the local files. The layout and the client are indexer.store.milvus's."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.search import ann
from indexer.search.specs import IndexSpec
from indexer.store import artifact
from indexer.store.artifact import BackendUnavailable
from indexer.store.fields import FieldColumns
from indexer.store.milvus import (
    DEFAULT_TIMEOUT_S,
    UNAVAILABLE_LOG_S,
    BackendError,
    call,
    connect,
    filter_expression,
    literal,
    search_params,
)
from indexer.store.recordstore import RecordStore, id_hash_of

log = logging.getLogger(__name__)


class _Calls:
    """The client's calls with a timeout each; an unreachable or slow Milvus raises
    BackendUnavailable (and is logged, at most every UNAVAILABLE_LOG_S)."""

    def __init__(self, uri: str, timeout_s: float):
        self.uri = uri
        self.timeout_s = timeout_s
        self.client = connect(uri, timeout_s)
        self._told = -float("inf")

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        c, uri, t = self.client, self.uri, self.timeout_s
        try:
            try:
                return call(c, uri, t, method, *args, **kwargs)
            except BackendUnavailable as exc:
                # A Milvus that restarted holds the collections but has not loaded them yet.
                if method not in ("search", "query") or "load" not in str(exc).lower():
                    raise
                call(c, uri, t, "load_collection", args[0])
                return call(c, uri, t, method, *args, **kwargs)
        except BackendUnavailable as exc:
            now = time.monotonic()
            if now - self._told >= UNAVAILABLE_LOG_S:
                self._told = now
                log.error("%s; answering 503 until it is back", exc)
            raise


class _Memo:
    """Record row -> (id, payload JSON) of recent results: a search reads them with its hits,
    and the response is formatted from here, without another round trip."""

    def __init__(self, size: int = 1 << 16):
        from cachetools import LRUCache

        self._items: LRUCache[int, tuple[str, bytes]] = LRUCache(size)
        self._lock = threading.Lock()

    def put(self, row: int, rid: str, payload: bytes) -> None:
        with self._lock:
            self._items[row] = (rid, payload)

    def get(self, row: int) -> tuple[str, bytes] | None:
        with self._lock:
            return self._items.get(row)


class MilvusRecords:
    """The record store's reading side (indexer.store.recordstore.RecordStore) over the
    version's records collection."""

    def __init__(self, calls: _Calls, collection: str, manifest: dict[str, Any], memo: _Memo):
        self.calls = calls
        self.collection = collection
        self.names: list[str] = manifest["modalities"]
        self.d = int(manifest["d"])
        self.count = int(manifest["counts"]["records"])
        self.fields = FieldColumns.declared(manifest.get("filter_fields") or {})
        self.memo = memo

    def __len__(self) -> int:
        return self.count

    def _row(self, row: int, fields: list[str]) -> dict[str, Any]:
        found = self.calls(
            "query", self.collection, filter=f"row == {int(row)}", output_fields=fields
        )
        if not found:
            raise BackendError(f"Milvus collection {self.collection} lacks row {row}")
        return dict(found[0])

    def _cached(self, row: int) -> tuple[str, bytes]:
        hit = self.memo.get(row)
        if hit is None:
            got = self._row(row, ["rid", "payload"])
            hit = (str(got["rid"]), str(got["payload"]).encode())
            self.memo.put(row, *hit)
        return hit

    def id_at(self, row: int) -> str:
        return self._cached(row)[0]

    def payload_json(self, row: int) -> bytes:
        return self._cached(row)[1]

    def _present(self, flags: Any) -> list[str]:
        """The modalities a row's presence string (one 0/1 per modality) marks."""
        return [n for n, f in zip(self.names, str(flags), strict=True) if f == "1"]

    def modalities(self, row: int) -> list[str]:
        return self._present(self._row(row, ["presence"])["presence"])

    def __getitem__(self, row: int) -> dict[str, Any]:
        got = self._row(row, ["rid", "payload", "presence"])
        return {
            "id": str(got["rid"]),
            "payload": orjson.loads(str(got["payload"])),
            "modalities": self._present(got["presence"]),
        }

    def row_of(self, record_id: str) -> int | None:
        found = self.calls(
            "query", self.collection, filter=f"rid == {literal(record_id)}", output_fields=["row"]
        )
        return int(found[0]["row"]) if found else None

    def embeddings_of(self, row: int) -> dict[str, list[float]]:
        got = self._row(row, ["emb", "presence"])
        emb = np.asarray(got["emb"], dtype=np.float32).reshape(len(self.names), self.d)
        present = self._present(got["presence"])
        return {n: emb[j].tolist() for j, n in enumerate(self.names) if n in present}

    def close(self) -> None:
        pass


class MilvusView:
    """One view searched in its Milvus collection: the same contract as indexer.search.view.View
    (scores and record rows, best first; a filter is a Milvus expression from mask_of)."""

    vectors: np.ndarray | None = None  # nothing is memory-mapped here
    remote: bool = True

    def __init__(
        self, calls: _Calls, name: str, entry: dict[str, Any], backend: dict[str, Any], memo: _Memo
    ):
        self.calls = calls
        self.name = name
        self.query = tuple(entry["query"])
        self.target = tuple(entry["target"])
        self.dim = int(entry["dim"])
        own = backend["views"][name]
        self.collection: str = own["collection"]
        self.spec = IndexSpec.from_dict(own["spec"])
        self.count = int(entry["count"])
        self.memo = memo

    def effort_used(self, effort: int | None, k: int) -> int | None:
        return ann.effort_used(self.spec, effort, k)

    @property
    def default_effort(self) -> int | None:
        return self.spec.effort

    def search_params(self, effort: int | None, k: int) -> dict[str, Any]:
        return search_params(self.spec, effort, k)

    def search(
        self,
        xq: np.ndarray,
        k: int,
        allowed: str | None = None,
        effort: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, record rows), (nq, k'); rows of -1 pad queries that found fewer."""
        k = min(k, self.count)
        if k == 0 or len(xq) == 0:
            return np.zeros((len(xq), 0), np.float32), np.zeros((len(xq), 0), np.int64)
        hits = self.calls(
            "search",
            self.collection,
            data=np.asarray(xq, np.float32).tolist(),
            limit=k,
            filter=allowed or "",
            output_fields=["row", "rid", "payload"],
            search_params=self.search_params(effort, k),
            anns_field="vector",
        )
        width = max((len(h) for h in hits), default=0)
        scores = np.full((len(xq), width), -np.inf, np.float32)
        rows = np.full((len(xq), width), -1, np.int64)
        for i, found in enumerate(hits):
            for j, hit in enumerate(found):
                entity = hit["entity"]
                row = int(entity["row"])
                scores[i, j], rows[i, j] = float(hit["distance"]), row
                self.memo.put(row, str(entity["rid"]), str(entity["payload"]).encode())
        return scores, rows


def served_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as /v1/info shows a Milvus version: each view's spec and recall are its
    collection's."""
    views = {}
    for name, entry in manifest["views"].items():
        own = manifest["backend"]["views"][name]
        views[name] = {
            **entry,
            "spec": own["spec"],
            "recall_at_10": own.get("recall_at_10"),
            "milvus": {"collection": own["collection"], "index": own["index"]},
        }
    return {**manifest, "views": views}


class MilvusVersion:
    """A published version on the milvus backend, opened for serving: its collections exist,
    hold the manifest's counts, and are loaded. Nothing but the manifest is read locally."""

    remote = True  # every read waits on the network

    def __init__(
        self,
        vdir: Path,
        manifest: dict[str, Any],
        uri: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        backend = manifest["backend"]
        self.path = vdir
        self.manifest = served_manifest(manifest)
        self.version: str = manifest["version"]
        self.names: list[str] = manifest["modalities"]
        self.uri = uri or backend["uri"]
        self.calls = _Calls(self.uri, timeout_s)
        memo = _Memo()
        expected = {backend["records"]: int(manifest["counts"]["records"])}
        for name, entry in manifest["views"].items():
            expected[backend["views"][name]["collection"]] = int(entry["count"])
        self.collections = list(expected)
        for collection, count in expected.items():
            if not self.calls("has_collection", collection):
                raise BackendError(
                    f"Milvus at {self.uri} has no collection {collection} (version "
                    f"{self.version}): was it dropped, or is this another Milvus?"
                )
            self.calls("load_collection", collection)
            held = int(self.calls("get_collection_stats", collection)["row_count"])
            if held != count:
                raise BackendError(
                    f"Milvus collection {collection} holds {held} rows, the manifest {count}"
                )
        self.records = MilvusRecords(self.calls, backend["records"], manifest, memo)
        self.views = {
            name: MilvusView(self.calls, name, entry, backend, memo)
            for name, entry in manifest["views"].items()
        }

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["model"]["fingerprint"])

    def probe(self) -> None:
        """Can this version answer? VersionGone when its manifest or one of its collections is
        no longer there (Milvus restarted without its data, a collection dropped);
        BackendUnavailable when Milvus does not answer. A collection Milvus holds but released
        (a restart with its data) is loaded again here, before a search needs it."""
        if not (self.path / artifact.MANIFEST).is_file():
            raise artifact.VersionGone(f"version {self.version}: {self.path} is gone")
        held = set(self.calls("list_collections"))
        for collection in self.collections:
            if collection not in held:
                raise artifact.VersionGone(
                    f"version {self.version}: Milvus at {self.uri} no longer holds its "
                    f"collection {collection} (restarted without its data, or dropped)"
                )
            state = self.calls("get_load_state", collection)["state"]
            if getattr(state, "name", str(state)) != "Loaded":
                self.calls("load_collection", collection)

    def mask_of(self, view: Any, flt: dict[str, Any]) -> str:
        """A filter as the expression the view's collection is searched with."""
        return filter_expression(flt, self.records.fields.types)

    def embeddings_of(self, row: int) -> dict[str, list[float]]:
        return self.records.embeddings_of(row)


VERIFY_SAMPLE = 64  # positions per collection whose vectors are compared with the local files


def verify_backend(vdir: Path, manifest: dict[str, Any], timeout_s: float = 60.0) -> list[str]:
    """A Milvus version's collections against its local files: every count, and the vectors,
    rows and ids of sampled positions (the local files are checked against their checksums
    and recomputed from the stored embeddings by indexer.store.verify)."""
    block = manifest["backend"]
    uri = str(block["uri"])
    store = RecordStore(vdir, manifest["modalities"], None, id_hash_of(manifest))
    try:
        client = connect(uri, timeout_s)

        def calls(method: str, *args: Any, **kwargs: Any) -> Any:
            return call(client, uri, timeout_s, method, *args, **kwargs)

        problems: list[str] = []
        rng = np.random.default_rng(0)
        n = int(manifest["counts"]["records"])
        names = manifest["modalities"]
        checks = [(block["records"], n, "row", None, "emb")]
        for view, entry in manifest["views"].items():
            checks.append(
                (block["views"][view]["collection"], int(entry["count"]), "pos", view, "vector")
            )
        for collection, count, key, view, vector in checks:
            if not calls("has_collection", collection):
                problems.append(f"Milvus collection {collection}: missing")
                continue
            calls("load_collection", collection)  # released by a restart: loaded, then read
            held = int(calls("get_collection_stats", collection)["row_count"])
            if held != count:
                problems.append(f"Milvus collection {collection}: {held} rows, manifest {count}")
                continue
            if count == 0:
                continue
            pick = np.sort(rng.choice(count, size=min(VERIFY_SAMPLE, count), replace=False))
            got = calls(
                "query",
                collection,
                filter=f"{key} in {pick.tolist()}",
                output_fields=[key, "row", "rid", vector],
            )
            if view is None:
                want = np.concatenate(
                    [
                        np.load(vdir / artifact.EMBEDDINGS / f"{m}.npy", mmap_mode="r")[pick]
                        for m in names
                    ],
                    1,
                )
                rows = pick
            else:
                base = vdir / artifact.VIEWS
                want = np.asarray(np.load(base / f"{view}.npy", mmap_mode="r")[pick])
                rows = np.asarray(np.load(base / f"{view}.rows.npy", mmap_mode="r")[pick])
            by_key = {int(g[key]): g for g in got}
            for i, p in enumerate(pick.tolist()):
                g = by_key.get(p)
                where = f"Milvus collection {collection}, {key} {p}"
                if g is None:
                    problems.append(f"{where}: missing")
                elif int(g["row"]) != int(rows[i]) or g["rid"] != store.id_at(int(rows[i])):
                    problems.append(f"{where}: row or id differs from the local record store")
                elif not np.allclose(np.asarray(g[vector], np.float32), want[i], atol=1e-5):
                    problems.append(f"{where}: vector differs from the local files")
        return problems
    except BackendUnavailable as exc:
        return [str(exc)]
    finally:
        store.close()
