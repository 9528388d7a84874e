"""Writing a staged version into Milvus (`--backend milvus`): its records collection and one
collection per view (the layout is indexer.store.milvus's), each indexed as `--spec` says,
flushed, loaded and counted before the version may be published; and removing collections
that no published version names (a killed job's, or those of versions gc removed).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from indexer.build.views import sample_queries
from indexer.search import exact
from indexer.search.specs import IndexSpec, SpecError, resolved_params
from indexer.store import artifact, milvus
from indexer.store.recordstore import RecordStore, id_hash_of
from indexer.store.rows import StoredRows
from models.heads import Head

log = logging.getLogger(__name__)

INSERT_BYTES = 8 << 20  # per insert call: well under Milvus's 64 MB per request
VARCHAR_MAX = 65_535  # Milvus's longest VARCHAR, in bytes
RECALL_QUERIES = 200
RECALL_K = 10


@dataclass
class MilvusTarget:
    uri: str
    prefix: str
    shards: int = 1
    timeout_s: float = 120.0  # index builds and loads of large collections take a while


def index_of(spec: IndexSpec, n: int) -> tuple[str, dict[str, int]]:
    """The Milvus index type and build parameters for a spec (metric IP)."""
    kind = milvus.INDEX_TYPES.get(spec.kind)
    if kind is None or spec.tuned:
        raise SpecError(
            f"--spec {spec}: with --backend milvus give flat, ivf, hnsw, ivfpq or ivfsq "
            "(auto measures FAISS indexes on this machine, not Milvus's)"
        )
    p = resolved_params(spec, n)
    params = {
        "FLAT": {},
        "IVF_FLAT": {"nlist": p.get("nlist", 0)},
        "IVF_SQ8": {"nlist": p.get("nlist", 0)},
        "IVF_PQ": {"nlist": p.get("nlist", 0), "m": p.get("m", 0), "nbits": p.get("nbits", 0)},
        "HNSW": {"M": p.get("M", 0), "efConstruction": p.get("ef_construction", 0)},
    }[kind]
    return kind, params


def varchar_lengths(stage: Path, store: RecordStore) -> dict[str, int]:
    """The `rid` and `payload` fields' lengths: the version's longest id and payload (bytes,
    at least 16); one over Milvus's limit stops the job, naming its record."""
    out = {}
    for field, what, name in (("rid", "id", "ids"), ("payload", "payload", "payloads")):
        sizes = np.diff(np.load(stage / "records" / f"{name}.offsets.npy", mmap_mode="r"))
        longest = int(sizes.max()) if len(sizes) else 0
        if longest > VARCHAR_MAX:
            raise artifact.ArtifactError(
                f"record {store.id_at(int(np.argmax(sizes)))!r}: its {what} is {longest} bytes, "
                f"over the {VARCHAR_MAX} Milvus holds in one field; keep large data outside the "
                "payload (a URI to it)"
            )
        out[field] = max(16, longest)
    return out


class _Writer:
    def __init__(self, target: MilvusTarget):
        self.target = target
        self.client = milvus.connect(target.uri, target.timeout_s)
        self.created: list[str] = []
        self.pymilvus = milvus.pymilvus_module()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        t = self.target
        return milvus.call(self.client, t.uri, t.timeout_s, method, *args, **kwargs)

    def create(self, name: str, schema: Any, field: str, kind: str, params: dict[str, int]) -> None:
        """A new collection with its index, not loaded yet (finish() loads it)."""
        index = self.client.prepare_index_params()
        index.add_index(field_name=field, index_type=kind, metric_type="IP", params=params)
        if self.call("has_collection", name):  # a dead run's, of this same version id
            milvus.drop_collection(self.client, self.target.uri, self.target.timeout_s, name)
        self.call("create_collection", name, schema=schema, num_shards=self.target.shards)
        self.created.append(name)
        self.call("create_index", name, index)

    def insert(self, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.call("insert", name, rows)

    def finish(self, counts: dict[str, int]) -> None:
        """Flush and load every collection, then count each: one that holds other than its
        count stops the job before anything is published. Milvus seals and loads each in the
        background and the client waits for it: the waits of all run at once."""
        with ThreadPoolExecutor(len(counts)) as pool:
            list(pool.map(lambda name: self.call("flush", name), counts))
            list(pool.map(lambda name: self.call("load_collection", name), counts))
        for name, count in counts.items():
            held = int(self.call("get_collection_stats", name)["row_count"])
            if held != count:
                raise artifact.ArtifactError(
                    f"Milvus collection {name} holds {held} rows after loading, expected {count}"
                )

    def drop_created(self) -> None:
        for name in self.created:
            try:
                milvus.drop_collection(self.client, self.target.uri, self.target.timeout_s, name)
            except Exception as exc:  # the next job's clean-up drops what is left
                log.warning("could not drop Milvus collection %s: %s", name, exc)


def _schema(w: _Writer, lengths: dict[str, int], key: str) -> Any:
    """A collection's schema with its primary key (`row` or `pos`), the record's row, id and
    payload (`lengths`: varchar_lengths)."""
    dt = w.pymilvus.DataType
    schema = w.client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field(key, dt.INT64, is_primary=True)
    if key != "row":
        schema.add_field("row", dt.INT64)
    for name, length in lengths.items():
        schema.add_field(name, dt.VARCHAR, max_length=length)
    return schema


def _chunk_rows(row_bytes: int) -> int:
    return max(1, INSERT_BYTES // max(1, row_bytes))


def _records(
    w: _Writer, lengths: dict[str, int], name: str, store: RecordStore, stored: StoredRows, d: int
) -> None:
    dt = w.pymilvus.DataType
    names = stored.names
    schema = _schema(w, lengths, "row")
    schema.add_field("presence", dt.VARCHAR, max_length=max(1, len(names)))
    schema.add_field("emb", dt.FLOAT_VECTOR, dim=len(names) * d)
    w.create(name, schema, "emb", "FLAT", {})
    step = _chunk_rows(4 * len(names) * d + 256)
    for start, ids, payloads, presence in store.iter_chunks(step):
        end = start + len(ids)
        idx = np.arange(start, end)
        emb = np.concatenate([np.asarray(stored.embeddings[n][idx]) for n in names], 1)
        flags = ["".join("1" if f else "0" for f in p) for p in presence.tolist()]
        w.insert(
            name,
            [
                {
                    "row": start + i,
                    "rid": ids[i],
                    "payload": payloads[i].decode(),
                    "presence": flags[i],
                    "emb": emb[i].tolist(),
                }
                for i in range(len(ids))
            ],
        )


def _view(
    w: _Writer,
    lengths: dict[str, int],
    name: str,
    rows: np.ndarray,
    vectors: np.ndarray,
    store: RecordStore,
    types: dict[str, str],
    spec: IndexSpec,
) -> tuple[str, dict[str, int]]:
    dt = w.pymilvus.DataType
    kind, params = index_of(spec, len(rows))
    schema = _schema(w, lengths, "pos")
    for field, col in milvus.field_slots(types).items():
        if types[field] == "numeric":
            schema.add_field(col, dt.DOUBLE)
            schema.add_field(f"h{col[1:]}", dt.BOOL)
        else:
            schema.add_field(col, dt.VARCHAR, max_length=VARCHAR_MAX)
    schema.add_field("vector", dt.FLOAT_VECTOR, dim=vectors.shape[1])
    w.create(name, schema, "vector", kind, params)
    step = _chunk_rows(4 * vectors.shape[1] + 512)
    for start in range(0, len(rows), step):
        part = np.asarray(rows[start : start + step])
        ids = [store.id_at(int(r)) for r in part]
        payloads = [store.payload_json(int(r)) for r in part]
        fields = milvus.field_columns(payloads, types)
        vecs = np.asarray(vectors[start : start + step])
        w.insert(
            name,
            [
                {
                    "pos": start + i,
                    "row": int(part[i]),
                    "rid": ids[i],
                    "payload": payloads[i].decode(),
                    "vector": vecs[i].tolist(),
                    **{c: v[i] for c, v in fields.items()},
                }
                for i in range(len(part))
            ],
        )
    return kind, params


def _recall(
    w: _Writer, name: str, vectors: np.ndarray, rows: np.ndarray, xq: np.ndarray, spec: IndexSpec
) -> float:
    """recall@10 of the collection's index, searched as the server searches it, against exact
    search over the view's vectors."""
    if len(xq) == 0 or len(rows) == 0:
        return float("nan")
    k = min(RECALL_K, len(rows))
    _, truth = exact.search(xq, vectors, k)
    hits = w.call(
        "search",
        name,
        data=xq.tolist(),
        limit=k,
        output_fields=["row"],
        search_params=milvus.search_params(spec, None, k),
        anns_field="vector",
    )
    pos_of_row = {int(r): p for p, r in enumerate(np.asarray(rows).tolist())}
    found = [
        len({pos_of_row[int(h["entity"]["row"])] for h in hs} & set(t.tolist()))
        for hs, t in zip(hits, truth, strict=True)
    ]
    return round(sum(found) / (k * len(xq)), 4)


def export(
    stage: Path,
    manifest: dict[str, Any],
    target: MilvusTarget,
    spec: IndexSpec,
    head: Head,
    stored: StoredRows,
) -> dict[str, Any]:
    """Write the staged version's collections; the manifest's `backend` block. On any failure
    the collections made so far are dropped."""
    for entry in manifest["views"].values():
        index_of(spec, int(entry["count"]))  # a spec Milvus cannot build stops the job first
    w = _Writer(target)
    views = list(manifest["views"])
    names = milvus.collection_names(target.prefix, manifest["version"], views)
    types = {n: str(f["type"]) for n, f in (manifest.get("filter_fields") or {}).items()}
    store = RecordStore(
        stage, manifest["modalities"], manifest.get("filter_fields"), id_hash_of(manifest)
    )
    block: dict[str, Any] = {
        "kind": "milvus",
        "uri": target.uri,
        "prefix": target.prefix,
        "shards": target.shards,
        "records": names["records"],
        "views": {},
    }
    try:
        lengths = varchar_lengths(stage, store)
        _records(w, lengths, names["records"], store, stored, int(manifest["d"]))
        counts = {names["records"]: len(store)}
        base = stage / artifact.VIEWS
        for view in views:
            entry = manifest["views"][view]
            collection = names["views"][view]
            rows = np.load(base / f"{view}.rows.npy", mmap_mode="r")
            vectors = np.load(base / f"{view}.npy", mmap_mode="r")
            kind, params = _view(w, lengths, collection, rows, vectors, store, types, spec)
            counts[collection] = len(rows)
            built = IndexSpec(spec.kind, resolved_params(spec, int(entry["count"])))
            block["views"][view] = {
                "collection": collection,
                "index": kind,
                "params": params,
                "spec": built.to_dict(),
                "recall_at_10": 1.0,
            }
        w.finish(counts)
        for view, own in block["views"].items():
            entry = manifest["views"][view]
            if own["index"] != "FLAT":
                # copy-on-write: torch (exact search, for the recall) refuses read-only arrays
                vectors = np.load(base / f"{view}.npy", mmap_mode="c")
                rows = np.load(base / f"{view}.rows.npy", mmap_mode="r")
                xq = sample_queries(head, stored, tuple(entry["query"]), RECALL_QUERIES, seed=1)
                built = IndexSpec.from_dict(own["spec"])
                own["recall_at_10"] = _recall(w, own["collection"], vectors, rows, xq, built)
            log.info(
                "view %s: Milvus %s in %s, recall@10 %s",
                view,
                own["index"],
                own["collection"],
                own["recall_at_10"],
            )
    except BaseException:
        w.drop_created()
        raise
    finally:
        store.close()
    return block
