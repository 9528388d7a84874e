"""Views held in Milvus (docs/milvus.md): the layout of a version's collections, the client
calls that read them, and a published version opened for serving from them.

A version on the `milvus` backend keeps its manifest (and, on the machine that built it, its
local files, which updates copy rows from) under the index root as any other; its manifest's
`backend` block names its collections:

    {prefix}_{version}_records   row (primary key), rid (the record id), payload (its JSON),
                                 presence (one 0/1 character per modality), emb (the
                                 per-modality embeddings side by side, m * d floats)
    {prefix}_{version}_v{i}      one per view: pos (primary key: the view's position), row,
                                 rid, payload, the filterable fields (f{j}: a number with
                                 h{j} saying whether the record has it, or the value's canonical
                                 JSON as a string, "" where missing), vector (the record factor)

The prefix is the root's own (ROOT/backend.json), so that roots sharing a Milvus never touch
each other's collections. A server given such a version needs nothing local but the manifest:
searches, records and stored embeddings are read from Milvus.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from indexer.search import ann
from indexer.search.specs import IndexSpec
from indexer.store import artifact
from indexer.store.artifact import BackendUnavailable
from indexer.store.fields import FieldColumns, _is_number, _key

log = logging.getLogger(__name__)

ROOT_FILE = "backend.json"  # ROOT/backend.json: the root's backend, URI and collection prefix
TOKEN_ENV = "HCLIP_MILVUS_TOKEN"  # never written into the root or a manifest
BACKENDS = ("faiss", "milvus")
DEFAULT_TIMEOUT_S = 10.0
# spec kind -> Milvus index type; `auto` measures FAISS indexes and has no Milvus form
INDEX_TYPES = {
    "flat": "FLAT",
    "ivf": "IVF_FLAT",
    "ivfip": "IVF_FLAT",
    "hnsw": "HNSW",
    "ivfpq": "IVF_PQ",
    "ivfsq": "IVF_SQ8",
}
UNAVAILABLE_LOG_S = 10.0  # how often a backend that stays down is said so


class BackendError(artifact.ArtifactError):
    """What Milvus holds disagrees with the manifest (a missing collection, a wrong count)."""


def slug(text: str) -> str:
    """A name part Milvus accepts: letters, digits and underscores."""
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def collection_names(prefix: str, version: str, views: list[str]) -> dict[str, Any]:
    base = f"{prefix}_{slug(version)}"
    return {"records": f"{base}_records", "views": {v: f"{base}_v{i}" for i, v in enumerate(views)}}


def alias_of(prefix: str, view_index: int) -> str:
    """The alias that follows CURRENT for a view (the i-th of the published version)."""
    return f"{prefix}_current_v{view_index}"


def field_slots(fields: Mapping[str, Any]) -> dict[str, str]:
    """Filterable field -> its column in a view's collection (field names are free text)."""
    return {name: f"f{j}" for j, name in enumerate(sorted(fields))}


# -- the root's backend -------------------------------------------------------------------------


def read_root(root: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads((root / ROOT_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise artifact.ArtifactError(f"{root / ROOT_FILE}: unreadable ({exc})") from None
    if not isinstance(obj, dict) or obj.get("kind") not in BACKENDS:
        raise artifact.ArtifactError(f"{root / ROOT_FILE}: names no backend of {BACKENDS}")
    return obj


def write_root(root: Path, kind: str, uri: str | None) -> dict[str, Any]:
    """Record the root's backend (keeping its collection prefix); only with the root lock."""
    old = read_root(root) or {}
    obj = {
        "kind": kind,
        "uri": uri or old.get("uri"),
        "prefix": old.get("prefix") or f"hclip_{secrets.token_hex(4)}",
    }
    tmp = root / f"{ROOT_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, root / ROOT_FILE)
    artifact.fsync_path(root)
    return obj


_VERSION_PART = re.compile(r"^(?P<version>\d{8}T\d{6}\d*Z_[0-9a-f]+)_(records|v\d+)$")


def drop_unpublished(root: Path, timeout_s: float = 60.0) -> list[str]:
    """Drop this root's collections that no version under versions/ names: a killed job's
    partial collections and those of versions gc removed. Only with the root lock held."""
    config = read_root(root)
    if config is None or not config.get("uri") or not config.get("prefix"):
        return []
    client = connect(str(config["uri"]), timeout_s)
    try:
        names = client.list_collections(timeout=timeout_s)
    except Exception as exc:
        if is_transient(exc):
            raise BackendUnavailable(f"Milvus at {config['uri']}: {_reason(exc)}") from None
        raise
    prefix = f"{config['prefix']}_"
    vroot = root / artifact.VERSIONS
    kept = {slug(p.name) for p in vroot.iterdir()} if vroot.is_dir() else set()
    dropped = []
    for name in names:
        if not name.startswith(prefix):
            continue
        found = _VERSION_PART.match(name[len(prefix) :])
        if found is None or found.group("version") in kept:
            continue
        client.drop_collection(name, timeout=timeout_s)
        dropped.append(name)
    if dropped:
        log.warning("dropped Milvus collections no published version names: %s", ", ".join(dropped))
    return dropped


def drop_version(block: Mapping[str, Any], timeout_s: float = 60.0) -> None:
    """Drop one version's collections (its manifest's backend block), what is left of them."""
    client = connect(str(block["uri"]), timeout_s)
    names = [block["records"], *(v["collection"] for v in block["views"].values())]
    for name in names:
        if client.has_collection(name, timeout=timeout_s):
            client.drop_collection(name, timeout=timeout_s)


# -- the client ---------------------------------------------------------------------------------


def _pymilvus() -> Any:
    from models.extras import require

    return require("pymilvus", "milvus", "the milvus backend")


def is_transient(exc: BaseException) -> bool:
    """An error of the connection or the server's state, not of the call's arguments."""
    pymilvus = _pymilvus()
    if isinstance(exc, pymilvus.exceptions.MilvusException):
        return True
    return type(exc).__module__.startswith(("grpc", "pymilvus"))


def connect(uri: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A MilvusClient for `uri` (a Milvus Lite file path, or http://host:19530), with the
    token from HCLIP_MILVUS_TOKEN."""
    pymilvus = _pymilvus()
    # pymilvus logs every failed call with its traceback; the errors are reported here, once.
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    try:
        return pymilvus.MilvusClient(
            uri=uri, token=os.environ.get(TOKEN_ENV, ""), timeout=timeout_s
        )
    except Exception as exc:
        if is_transient(exc):
            raise BackendUnavailable(f"Milvus at {uri}: cannot connect ({_reason(exc)})") from None
        raise


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]


def _literal(value: str) -> str:
    """A string as a Milvus expression's double-quoted literal."""
    return json.dumps(value, ensure_ascii=False)


# -- filters ------------------------------------------------------------------------------------


def filter_expression(flt: Mapping[str, Any], types: Mapping[str, str]) -> str:
    """A filter (already validated against the fields, indexer.store.fields) as a Milvus
    boolean expression over a view's columns; the same rows match as in the FAISS backend."""
    slots = field_slots(types)
    parts = []
    for name, cond in flt.items():
        col = slots[name]
        if types[name] == "numeric":
            has = f"h{col[1:]} == true"
            if isinstance(cond, dict) and "in" in cond:
                values = ", ".join(repr(float(v)) for v in cond["in"])
                parts.append(f"({has} and {col} in [{values}])")
            elif isinstance(cond, dict):
                ops = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
                terms = " and ".join(f"{col} {ops[op]} {float(b)!r}" for op, b in cond.items())
                parts.append(f"({has} and {terms})")
            else:
                parts.append(f"({has} and {col} == {float(cond)!r})")
            continue
        wanted = cond["in"] if isinstance(cond, dict) else [cond]
        keys = ", ".join(_literal(_key(v)) for v in wanted)
        parts.append(f"{col} in [{keys}]")
    return " and ".join(parts)


def field_columns(payloads: list[bytes], types: Mapping[str, str]) -> dict[str, list[Any]]:
    """The filterable fields' columns of a chunk of rows, as a view's collection holds them."""
    objs = [orjson.loads(p) for p in payloads]
    out: dict[str, list[Any]] = {}
    for name, col in field_slots(types).items():
        values = [o.get(name) for o in objs]
        if types[name] == "numeric":
            out[col] = [float(v) if _is_number(v) else 0.0 for v in values]
            out[f"h{col[1:]}"] = [_is_number(v) for v in values]
        else:
            out[col] = ["" if v is None else _key(v) for v in values]
    return out


def search_params(spec: IndexSpec, effort: int | None, k: int) -> dict[str, Any]:
    """A search's parameters: metric IP, and the effort as the index type names it."""
    used = ann.effort_used(spec, effort, k)
    params: dict[str, Any] = {"metric_type": "IP"}
    if used is not None:
        params["params"] = {"ef": used} if spec.kind == "hnsw" else {"nprobe": used}
    return params


# -- serving ------------------------------------------------------------------------------------


class _Calls:
    """The client's calls with a timeout each; an unreachable or slow Milvus raises
    BackendUnavailable (and is logged, at most every UNAVAILABLE_LOG_S)."""

    def __init__(self, uri: str, timeout_s: float):
        self.uri = uri
        self.timeout_s = timeout_s
        self.client = connect(uri, timeout_s)
        self._told = -float("inf")

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return getattr(self.client, method)(*args, timeout=self.timeout_s, **kwargs)
            except Exception as exc:
                # A Milvus that restarted holds the collections but has not loaded them yet.
                if method not in ("search", "query") or "load" not in _reason(exc).lower():
                    raise
                self.client.load_collection(args[0], timeout=self.timeout_s)
                return getattr(self.client, method)(*args, timeout=self.timeout_s, **kwargs)
        except Exception as exc:
            if not is_transient(exc):
                raise
            message = f"Milvus at {self.uri}: {method} failed ({_reason(exc)})"
            now = time.monotonic()
            if now - self._told >= UNAVAILABLE_LOG_S:
                self._told = now
                log.error("%s; answering 503 until it is back", message)
            raise BackendUnavailable(message) from None


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

    def modalities(self, row: int) -> list[str]:
        flags = str(self._row(row, ["presence"])["presence"])
        return [n for n, f in zip(self.names, flags, strict=True) if f == "1"]

    def __getitem__(self, row: int) -> dict[str, Any]:
        got = self._row(row, ["rid", "payload", "presence"])
        flags = str(got["presence"])
        return {
            "id": str(got["rid"]),
            "payload": orjson.loads(str(got["payload"])),
            "modalities": [n for n, f in zip(self.names, flags, strict=True) if f == "1"],
        }

    def row_of(self, record_id: str) -> int | None:
        found = self.calls(
            "query", self.collection, filter=f"rid == {_literal(record_id)}", output_fields=["row"]
        )
        return int(found[0]["row"]) if found else None

    def embeddings_of(self, row: int) -> dict[str, list[float]]:
        got = self._row(row, ["emb", "presence"])
        emb = np.asarray(got["emb"], dtype=np.float32).reshape(len(self.names), self.d)
        flags = str(got["presence"])
        return {
            n: emb[j].tolist()
            for j, (n, f) in enumerate(zip(self.names, flags, strict=True))
            if f == "1"
        }

    def close(self) -> None:
        pass


class MilvusView:
    """One view searched in its Milvus collection: the same contract as indexer.search.view.View
    (scores and record rows, best first; a filter is a Milvus expression from mask_of)."""

    vectors: np.ndarray | None = None  # nothing is memory-mapped here
    products_from: int = 0
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
        parts: int = 1,
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
    try:
        calls = _Calls(str(block["uri"]), timeout_s)
        problems: list[str] = []
        rng = np.random.default_rng(0)
        ids_of = _local_ids(vdir, manifest)
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
                elif int(g["row"]) != int(rows[i]) or g["rid"] != ids_of(int(rows[i])):
                    problems.append(f"{where}: row or id differs from the local record store")
                elif not np.allclose(np.asarray(g[vector], np.float32), want[i], atol=1e-5):
                    problems.append(f"{where}: vector differs from the local files")
        return problems
    except BackendUnavailable as exc:
        return [str(exc)]


def _local_ids(vdir: Path, manifest: dict[str, Any]) -> Any:
    from indexer.store.recordstore import RecordStore, id_hash_of

    store = RecordStore(vdir, manifest["modalities"], None, id_hash_of(manifest))
    return store.id_at


def point_aliases(manifest: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Where the server has aliases: {prefix}_current_v{i} follows the published version's
    view collections (for other tools that read them). Best effort: CURRENT is the truth."""
    block = manifest.get("backend") or {}
    if block.get("kind") != "milvus":
        return
    try:
        client = connect(str(block["uri"]), timeout_s)
        for i, view in enumerate(manifest["views"]):
            alias = alias_of(block["prefix"], i)
            target = block["views"][view]["collection"]
            try:
                client.alter_alias(target, alias, timeout=timeout_s)
            except Exception:
                client.create_alias(target, alias, timeout=timeout_s)
    except Exception as exc:
        log.warning("Milvus aliases not moved (the server may not support them): %s", exc)
