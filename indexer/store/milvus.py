"""Views held in Milvus (docs/milvus.md): the layout of a version's collections, the root's
backend, the client, filters as Milvus expressions, and the clean-up of collections no
published version names. Serving from them: indexer.store.milvus_served.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson

from indexer.search import ann
from indexer.search.specs import IndexSpec
from indexer.store import artifact
from indexer.store.artifact import BackendUnavailable
from indexer.store.fields import _is_number, _key

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
    uri = str(config["uri"])
    client = connect(uri, timeout_s)
    names = call(client, uri, timeout_s, "list_collections")
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
        drop_collection(client, uri, timeout_s, name)
        dropped.append(name)
    if dropped:
        log.warning("dropped Milvus collections no published version names: %s", ", ".join(dropped))
    return dropped


def drop_version(block: Mapping[str, Any], timeout_s: float = 60.0) -> None:
    """Drop one version's collections (its manifest's backend block), what is left of them."""
    uri = str(block["uri"])
    client = connect(uri, timeout_s)
    names = [block["records"], *(v["collection"] for v in block["views"].values())]
    for name in names:
        if call(client, uri, timeout_s, "has_collection", name):
            drop_collection(client, uri, timeout_s, name)


def drop_collection(client: Any, uri: str, timeout_s: float, name: str) -> None:
    """Drop a collection and first the aliases that name it: Milvus 2.5 refuses to drop a
    collection an alias names, 2.3 drops its aliases with it."""
    found = call(client, uri, timeout_s, "list_aliases", name)
    for alias in found["aliases"] if isinstance(found, dict) else found:
        call(client, uri, timeout_s, "drop_alias", alias)
    call(client, uri, timeout_s, "drop_collection", name)


# -- the client ---------------------------------------------------------------------------------


def pymilvus_module() -> Any:
    from models.extras import require

    return require("pymilvus", "milvus", "the milvus backend")


def is_transient(exc: BaseException) -> bool:
    """An error of the connection or the server's state, not of the call's arguments."""
    pymilvus = pymilvus_module()
    if isinstance(exc, pymilvus.exceptions.MilvusException):
        return True
    return type(exc).__module__.startswith(("grpc", "pymilvus"))


def is_lite(uri: str) -> bool:
    """A Milvus Lite data path, which one process at a time can open (pymilvus starts a Milvus
    Lite of its own on it), not the address of a server: pymilvus's own test."""
    return urlparse(uri).scheme.lower() not in ("unix", "http", "https", "tcp", "grpc")


def connect(uri: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A MilvusClient for `uri` (a Milvus Lite file path, or http://host:19530), with the
    token from HCLIP_MILVUS_TOKEN."""
    pymilvus = pymilvus_module()
    # pymilvus logs every failed call with its traceback; the errors are reported here, once.
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)
    try:
        return pymilvus.MilvusClient(
            uri=uri, token=os.environ.get(TOKEN_ENV, ""), timeout=timeout_s
        )
    except Exception as exc:
        if is_transient(exc):
            raise unavailable(uri, "cannot connect", exc, timeout_s) from None
        raise


def call(client: Any, uri: str, timeout_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
    """`client.method(...)` with a deadline; a connection or server error (not one of the
    call's arguments) raises BackendUnavailable naming Milvus, the call and why."""
    try:
        return getattr(client, method)(*args, timeout=timeout_s, **kwargs)
    except Exception as exc:
        if not is_transient(exc):
            raise
        raise unavailable(uri, f"{method} failed", exc, timeout_s) from None


_REFUSED = ("UNAUTHENTICATED", "PERMISSION_DENIED")


def unavailable(uri: str, what: str, exc: BaseException, timeout_s: float) -> BackendUnavailable:
    """The BackendUnavailable for a failed connection or call: a token Milvus refused (or one
    it wants and was not given) is said so, not taken for an unreachable server."""
    why = reason(exc)
    if why.startswith(_REFUSED):
        given = bool(os.environ.get(TOKEN_ENV))
        hint = (
            f"it refused the token in {TOKEN_ENV}"
            if given
            else f"it wants a token: set {TOKEN_ENV} (user:password, or an API key)"
        )
        return BackendUnavailable(
            f"Milvus at {uri}: {what}: {hint} ({why})",
            "the vector database (Milvus) refused the service's credentials",
        )
    return BackendUnavailable(f"Milvus at {uri}: {what} ({why})", public(exc, timeout_s))


_GRPC_STATUS = re.compile(r"status = StatusCode\.(\w+)")
_GRPC_DETAILS = re.compile(r'details = "([^"]*)"')


def reason(exc: BaseException) -> str:
    """An error of the client in one short line: a gRPC error's status and details, not its
    repr (`<_InactiveRpcError of RPC that terminated with: ...>`); where pymilvus wraps the
    gRPC error in words of its own (a refused connection: "illegal connection params or
    server unavailable"), the gRPC error it was raised from."""
    cause = exc.__cause__
    code, details = getattr(cause, "code", None), getattr(cause, "details", None)
    if callable(code) and callable(details):
        status = getattr(code(), "name", None)
        if status:
            return f"{status}: {details()}"[:300]
    text = " ".join(str(getattr(exc, "message", None) or exc or type(exc).__name__).split())
    status = _GRPC_STATUS.search(text)
    if status is not None:
        found = _GRPC_DETAILS.search(text)
        text = status.group(1) + (f": {found.group(1)}" if found else "")
    return text[:300]


def timed_out(exc: BaseException) -> bool:
    text = str(getattr(exc, "message", None) or exc)
    return (
        isinstance(exc, TimeoutError)
        or "DEADLINE_EXCEEDED" in text
        or "Timeout" in type(exc).__name__
    )


def public(exc: BaseException, timeout_s: float) -> str:
    """What a client is told of a failed call: the service's words, none of the client's."""
    if timed_out(exc):
        return f"the vector database (Milvus) did not answer within {timeout_s:g} s"
    return "the vector database (Milvus) is unreachable or refused the call"


# Milvus's expression parser knows only these escapes (no \\uXXXX, \\xXX or octal); every other
# character, control characters and NUL included, stands for itself inside the quotes.
_LITERAL_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"})


def literal(value: str) -> str:
    """A string as a Milvus expression's double-quoted literal that matches it exactly: every
    id and filter value goes into an expression through this."""
    return '"' + value.translate(_LITERAL_ESCAPES) + '"'


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
        keys = ", ".join(literal(_key(v)) for v in wanted)
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
