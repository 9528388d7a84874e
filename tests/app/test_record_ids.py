"""Every id a records file may hold comes back exactly, on both backends: through
GET /v1/records?id= and /v1/embeddings?id= (any id: a path segment cannot hold a '/'), the
path forms for ids without '/', and the client; ids and filter values with quotes,
backslashes, control characters and newlines are escaped right in Milvus expressions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from app.client import Client
from tests.app.conftest import build_index, records_v, running, settings_for
from tests.conftest import make_model_dir

IDS = [
    "a/b", "x/../y", "/lead", 'say "hi"', "back\\slash", 'mix\\"', "sp ace", "a?b&c=d#e",
    "%2F", "é😀", "ctl\x01", "new\nline", "cr\rlf", "tab\tx", "embeddings", "'single'",
]  # fmt: skip
COLORS = ["ctl\x01", 'q"\\', "new\nline", "plain"]


def rows() -> list[dict]:
    out = records_v("v1", n=60)
    for i, r in enumerate(out):
        if i < len(IDS):
            r["id"] = IDS[i]
        r["payload"]["color"] = COLORS[i % len(COLORS)]
    return out


@pytest.fixture(scope="module", params=["faiss", "milvus", "milvus-standalone"])
def served(request, tmp_path_factory) -> Iterator[tuple[Path, list[dict]]]:
    """A root on each backend (Milvus: a Milvus Lite server of the module's own, and the
    session's Milvus standalone, whose expression parser is the real engine's)."""
    tmp = tmp_path_factory.mktemp(request.param)
    data = rows()
    extra = ["--filter-fields", "color"]
    with contextlib.ExitStack() as stack:
        if request.param == "milvus":
            pytest.importorskip("pymilvus", reason="the 'milvus' extra (CI installs it)")
            from benchmarks.milvus_servers import lite

            uri, _ = stack.enter_context(lite(tmp / "milvus"))
            extra += ["--backend", "milvus", "--milvus-uri", uri]
        elif request.param == "milvus-standalone":
            server = request.getfixturevalue("milvus_standalone")
            stack.callback(server.empty)
            extra += ["--backend", "milvus", "--milvus-uri", server.uri, "--views", "a,b+c"]
        build_index(tmp / "root", make_model_dir(tmp / "model"), data, tmp, *extra)
        yield tmp / "root", data


def test_any_id_round_trips_through_the_query_forms_and_the_client(served) -> None:
    root, data = served
    by_id = {r["id"]: r for r in data}
    with running(settings_for(root)) as http, Client(str(http.base_url)) as client:
        for rid in IDS:
            r = http.get("/v1/records", params={"id": rid})
            assert r.status_code == 200, (rid, r.text)
            assert r.json()["id"] == rid and r.json()["payload"] == by_id[rid]["payload"]
            e = http.get("/v1/embeddings", params={"id": rid})
            assert e.status_code == 200, (rid, e.text)
            assert e.json()["id"] == rid and set(e.json()["embeddings"]) <= {"a", "b", "c"}
            assert client.record(rid).id == rid
            assert client.record_embeddings(rid).id == rid
        for missing in ("nope", "\x00", "a\x00b", '"', "\\"):
            assert http.get("/v1/records", params={"id": missing}).status_code == 404, missing
            assert http.get("/v1/embeddings", params={"id": missing}).status_code == 404, missing
        for route in ("/v1/records", "/v1/embeddings"):
            assert http.get(route).json()["error_type"] == "validation_error"
            assert http.get(route, params={"id": ""}).status_code == 422


def test_ids_without_a_slash_round_trip_through_the_path_forms(served) -> None:
    root, _ = served
    with running(settings_for(root)) as http:
        for rid in (i for i in IDS if "/" not in i):
            r = http.get(f"/v1/records/{quote(rid, safe='')}")
            assert r.status_code == 200 and r.json()["id"] == rid, (rid, r.text)
            e = http.get(f"/v1/records/{quote(rid, safe='')}/embeddings")
            assert e.status_code == 200 and e.json()["id"] == rid, (rid, e.text)


def test_filter_values_match_exactly_whatever_they_hold(served) -> None:
    root, data = served
    query = {"query": {"a": data[0]["a"]}, "k": 60}
    with running(settings_for(root)) as http:
        everything = http.post("/v1/search", json=query).json()["results"]  # every record in view
        for color in COLORS:
            r = http.post("/v1/search", json={**query, "filter": {"color": color}})
            assert r.status_code == 200, (color, r.text)
            want = {h["id"] for h in everything if h["payload"]["color"] == color}
            assert {h["id"] for h in r.json()["results"]} == want and len(want) >= 10
        for absent in ("nul\x00", "ctl\x01x", "\\", '"'):
            r = http.post("/v1/search", json={**query, "filter": {"color": absent}})
            assert r.status_code == 200 and r.json()["results"] == [], (absent, r.text)


def test_the_query_forms_ask_for_a_key_and_are_in_the_contract(served) -> None:
    root, _ = served
    with running(settings_for(root, api_keys="alpha")) as http:
        for route in ("/v1/records", "/v1/embeddings"):
            assert http.get(route, params={"id": "a/b"}).status_code == 401
            ok = http.get(route, params={"id": "a/b"}, headers={"authorization": "Bearer alpha"})
            assert ok.status_code == 200
            doc = http.get("/openapi.json").json()["paths"][route]["get"]
            assert [(p["name"], p["in"], p["required"]) for p in doc["parameters"]] == [
                ("id", "query", True)
            ]
