"""Views in Milvus (`--backend milvus`), against real servers in processes of their own: the
same answers as the FAISS backend, updates, a replica that holds nothing but the manifest, a
swap under load, collections released and dropped, the backend stopped and started again under
load, a token checked, and a killed build.

Tests taking `milvus` run on Milvus Lite and Milvus standalone (the real engine), the token's
on standalone; the rest test the service's handling of the client, not the engine: Lite only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.milvus_servers import Lite, Standalone
from benchmarks.milvus_servers import lite as milvus_server
from indexer.store.milvus import TOKEN_ENV
from tests.app.conftest import build_index, free_port, records_v, running, settings_for, wait_until
from tests.conftest import make_model_dir, run_cli, write_jsonl

pymilvus = pytest.importorskip("pymilvus", reason="the 'milvus' extra (CI installs it)")
FIELDS = "color,year,symbol"
QUERY_SETS = [("a",), ("b",), ("c",), ("a", "b"), ("a", "c"), ("b", "c")]


def rows_with_fields(prefix: str, n: int = 300, seed: int = 0) -> list[dict]:
    rows = records_v(prefix, n, seed)
    for i, r in enumerate(rows):
        r["payload"]["color"] = ["red", "blue", "green", 'say "hi"\\'][i % 4]
        if i % 7:
            r["payload"]["year"] = 1990 + i % 30
    return rows


ENGINES = ["lite", "standalone"]


@pytest.fixture(scope="module", params=ENGINES)
def milvus(request, tmp_path_factory) -> Iterator[str]:
    """The URI of a Milvus: a Milvus Lite server of the module's own, or the session's Milvus
    standalone (the real engine, benchmarks.milvus_servers)."""
    if request.param == "standalone":
        server = request.getfixturevalue("milvus_standalone")
        yield server.uri
        server.empty()
        return
    with milvus_server(tmp_path_factory.mktemp("milvus")) as (uri, _):
        yield uri


@pytest.fixture(scope="module")
def both(tmp_path_factory, milvus) -> tuple[Path, Path, Path, list[dict]]:
    """The same records and model on each backend: (faiss root, milvus root, model, rows)."""
    tmp = tmp_path_factory.mktemp("both")
    model = make_model_dir(tmp / "model")
    rows = rows_with_fields("v1")
    build_index(tmp / "faiss", model, rows, tmp, "--filter-fields", FIELDS)
    build_index(tmp / "milvus", model, rows, tmp, "--filter-fields", FIELDS,
                "--backend", "milvus", "--milvus-uri", milvus)  # fmt: skip
    return tmp / "faiss", tmp / "milvus", model, rows


def queries(rows: list[dict], n: int = 4) -> Iterator[dict]:
    """Raw queries for every view, taken from records' own modalities."""
    for names in QUERY_SETS:
        for r in rows[1 : 1 + n]:
            yield {"query": {m: r[m] for m in names}, "k": 10}


FILTERS = [
    None,
    {"color": "blue"},
    {"color": 'say "hi"\\'},
    {"color": {"in": ["red", "green"]}},
    {"year": {"gte": 2000, "lt": 2010}},
    {"symbol": {"in": [1, 2, 3]}, "color": "red"},
    {"year": 1996, "color": "green"},  # fewer matches than k
    {"color": "purple"},  # none
]


def search(client: httpx.Client, body: dict) -> dict:
    r = client.post("/v1/search", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same(a: dict, b: dict, tol: float = 1e-4) -> None:
    assert [x["id"] for x in a["results"]] == [x["id"] for x in b["results"]]
    for x, y in zip(a["results"], b["results"], strict=True):
        assert abs(x["score"] - y["score"]) <= tol * max(1.0, abs(x["score"]))
        assert x["payload"] == y["payload"]


def test_flat_views_answer_as_the_faiss_backend_with_and_without_filters(both) -> None:
    faiss_root, milvus_root, _, rows = both
    with running(settings_for(faiss_root)) as fa, running(settings_for(milvus_root)) as mv:
        info = mv.get("/v1/info").json()
        assert {v["milvus"]["index"] for v in info["views"].values()} == {"FLAT"}
        compared = 0
        for body in queries(rows):
            for flt in FILTERS:
                b = body | ({"filter": flt} if flt else {})
                a, m = search(fa, b), search(mv, b)
                assert_same(a, m)
                compared += 1
                if flt == {"color": "purple"}:
                    assert m["results"] == []
        assert compared == len(QUERY_SETS) * 4 * len(FILTERS)
        few = search(mv, next(queries(rows)) | {"filter": {"year": 1996, "color": "green"}})
        assert 0 < len(few["results"]) < 10
        rid = rows[5]["id"]
        assert mv.get(f"/v1/records/{rid}").json() == fa.get(f"/v1/records/{rid}").json() | {
            "index_version": mv.get(f"/v1/records/{rid}").json()["index_version"]
        }
        emb_f = fa.get(f"/v1/records/{rid}/embeddings").json()["embeddings"]
        emb_m = mv.get(f"/v1/records/{rid}/embeddings").json()["embeddings"]
        assert emb_f.keys() == emb_m.keys()
        for name in emb_f:
            np.testing.assert_allclose(emb_f[name], emb_m[name], atol=1e-6)
        assert mv.get("/v1/records/no-such-id").status_code == 404
        bad = mv.post("/v1/search", json=next(queries(rows)) | {"filter": {"nope": 1}})
        assert bad.status_code == 422 and "filter.nope" in bad.json()["error"]


def test_an_approximate_spec_reports_its_recall(tmp_path, both, milvus) -> None:
    _, milvus_root, model, rows = both
    root = tmp_path / "hnsw"
    build_index(root, model, rows, tmp_path, "--backend", "milvus", "--milvus-uri", milvus,
                "--spec", "hnsw:M=8,ef_construction=40,ef_search=16")  # fmt: skip
    manifest = json.loads(next(root.glob("versions/*/manifest.json")).read_text())
    recalls = [v["recall_at_10"] for v in manifest["backend"]["views"].values()]
    assert all(0.0 <= r <= 1.0 for r in recalls), recalls
    with running(settings_for(root)) as approx, running(settings_for(milvus_root)) as flat:
        info = approx.get("/v1/info").json()
        assert {v["milvus"]["index"] for v in info["views"].values()} == {"HNSW"}
        hits = total = 0
        for body in queries(rows, 8):
            truth = {x["id"] for x in search(flat, body)["results"]}
            got = search(approx, body)
            assert got["effort"] == 16
            hits += len(truth & {x["id"] for x in got["results"]})
            total += len(truth)
        print(f"HNSW through the API: recall@10 {hits / total:.3f}; at build: {recalls}")
        assert hits / total >= 0.8


def test_updates_and_deletes_answer_as_the_faiss_backend(tmp_path, both, milvus) -> None:
    faiss_src, milvus_src, _, rows = both
    faiss_root, milvus_root = tmp_path / "faiss", tmp_path / "milvus"
    shutil.copytree(faiss_src, faiss_root)
    shutil.copytree(milvus_src, milvus_root)  # its backend.json: the same Milvus and prefix
    upserts = rows_with_fields("v1", 40, seed=5)[:20]
    for r in upserts:
        r["payload"]["color"] = "red"
    new = rows_with_fields("new", 10, seed=9)
    write_jsonl(tmp_path / "up.jsonl", upserts + new)
    (tmp_path / "del.txt").write_text("\n".join(r["id"] for r in rows[100:130]))
    for root in (faiss_root, milvus_root):
        assert run_cli("index", "update", "--root", root, "--upsert", tmp_path / "up.jsonl",
                       "--delete", tmp_path / "del.txt", "--quiet") == 0  # fmt: skip
    manifest = json.loads((milvus_root / "versions" / (milvus_root / "CURRENT").read_text().strip()
                           / "manifest.json").read_text())  # fmt: skip
    assert manifest["backend"]["kind"] == "milvus" and manifest["counts"]["records"] == 280
    with running(settings_for(faiss_root)) as fa, running(settings_for(milvus_root)) as mv:
        for body in queries(upserts + new, 2):
            for flt in (None, {"color": "red"}):
                b = body | ({"filter": flt} if flt else {})
                assert_same(search(fa, b), search(mv, b))
        gone = rows[110]["id"]
        assert mv.get(f"/v1/records/{gone}").status_code == 404
        assert mv.get(f"/v1/records/{new[0]['id']}").json()["payload"] == new[0]["payload"]
    assert run_cli("index", "verify", "--root", milvus_root) == 0
    # The aliases follow CURRENT, through a rollback too.
    client = pymilvus.MilvusClient(uri=milvus)
    prefix = json.loads((milvus_root / "backend.json").read_text())["prefix"]

    def aliased() -> str:
        return str(client.describe_alias(f"{prefix}_current_v0")["collection_name"])

    assert aliased() == manifest["backend"]["views"]["a"]["collection"]
    assert run_cli("index", "rollback", "--root", milvus_root) == 0
    old = (milvus_root / "CURRENT").read_text().strip()
    assert old != manifest["version"] and aliased().endswith(f"{old.replace('-', '_')}_v0")


def test_a_replica_serves_from_the_manifest_alone(tmp_path, both) -> None:
    faiss_root, milvus_root, _, rows = both
    version = (milvus_root / "CURRENT").read_text().strip()
    replica = tmp_path / "replica"
    (replica / "versions" / version).mkdir(parents=True)
    shutil.copy(milvus_root / "versions" / version / "manifest.json",
                replica / "versions" / version / "manifest.json")  # fmt: skip
    (replica / "CURRENT").write_text(version + "\n")
    with running(settings_for(faiss_root)) as fa, running(settings_for(replica)) as mv:
        for body in list(queries(rows, 1)):
            assert_same(search(fa, body), search(mv, body))


def test_a_released_collection_is_loaded_again_and_a_dropped_one_stops_the_version(
    tmp_path, milvus
) -> None:
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "root"
    v1 = build_index(root, model, records_v("v1", 100), tmp_path, "--backend", "milvus",
                     "--milvus-uri", milvus, "--views", "a")  # fmt: skip
    block = json.loads((root / "versions" / v1 / "manifest.json").read_text())["backend"]
    view, records = block["views"]["a"]["collection"], block["records"]
    client = pymilvus.MilvusClient(uri=milvus)

    def loaded(collection: str) -> bool:
        return str(client.get_load_state(collection)["state"].name) == "Loaded"

    body = {"query": {"a": [0.1] * 6}, "k": 3}
    with running(settings_for(root, milvus_timeout_s=5.0)) as http:
        client.release_collection(view)
        assert not loaded(view)
        wait_until(lambda: http.get("/readyz").status_code == 200 and loaded(view), 60)
        assert len(search(http, body)["results"]) == 3
        client.drop_collection(records)  # the view's has the alias, which 2.5 will not drop

        def says_gone() -> bool:
            r = http.get("/readyz")
            return r.status_code == 503 and "cannot be served" in r.json()["error"]

        wait_until(says_gone, 60)
        error = http.get("/readyz").json()["error"]
        assert f"no longer holds its collection {records}" in error, error
        r = http.post("/v1/search", json={"query": {"a": [0.2] * 6}, "k": 3})
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready", r.text


def load(client: httpx.Client, stop: threading.Event, out: list) -> None:
    """Searches one after another until `stop`, each a new query (no cache hit): (status,
    Retry-After, body) of each."""
    rng = np.random.default_rng(len(out))
    while not stop.is_set():
        body = {"query": {"a": rng.standard_normal(6).round(4).tolist()}, "k": 5}
        r = client.post("/v1/search", json=body)
        out.append((r.status_code, r.headers.get("retry-after"), r.json()))


def test_a_swap_under_load_never_mixes_versions(tmp_path, milvus) -> None:
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "root"
    milvus_args = ("--backend", "milvus", "--milvus-uri", milvus)
    v1 = build_index(root, model, records_v("v1"), tmp_path, *milvus_args, "--views", "a")
    stop, out = threading.Event(), []
    with running(settings_for(root)) as client:
        loaders = [threading.Thread(target=load, args=(client, stop, out)) for _ in range(3)]
        for t in loaders:
            t.start()
        try:
            # the root's backend
            v2 = build_index(root, model, records_v("v2", seed=1), tmp_path, "--views", "a")
            wait_until(lambda: client.get("/v1/info").json()["index_version"] == v2)
            seen = len(out)
            wait_until(lambda: len(out) > seen + 20)
        finally:
            stop.set()
            for t in loaders:
                t.join()
    assert {s for s, _, _ in out} == {200}
    prefix = {v1: "v1-", v2: "v2-"}
    versions = {body["index_version"] for _, _, body in out}
    assert versions == {v1, v2}
    for _, _, body in out:
        assert all(x["id"].startswith(prefix[body["index_version"]]) for x in body["results"])


@pytest.fixture(scope="module")
def milvus_auth(tmp_path_factory) -> Iterator[Standalone]:
    """A Milvus standalone of the module's own with authorization on (user root, password
    Milvus), which tests may stop and start."""
    pytest.importorskip("milvus", reason="the 'milvus-server' extra (CI installs it)")
    server = Standalone(tmp_path_factory.mktemp("milvus-auth"), authorization=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_milvus_stopped_under_load_answers_503_and_the_service_recovers(tmp_path) -> None:
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "root"
    stoppable = Lite(tmp_path / "milvus")
    stoppable.start()
    stop, out = threading.Event(), []
    settings = settings_for(root, milvus_timeout_s=2.0, request_timeout_s=5.0)
    build_index(root, model, records_v("v1"), tmp_path, "--backend", "milvus",
                "--milvus-uri", stoppable.uri, "--views", "a")  # fmt: skip
    with running(settings) as client:
        loader = threading.Thread(target=load, args=(client, stop, out))
        loader.start()
        try:
            wait_until(lambda: len(out) > 10, 60)
            stoppable.stop()  # Milvus goes away under load
            up = len(out)
            wait_until(lambda: sum(s == 503 for s, _, _ in out[up:]) >= 5, 60)
            with running(settings, wait_ready=False) as fresh:
                time.sleep(0.5)
                assert fresh.get("/readyz").status_code == 503  # cannot load its version
            stoppable.start()  # back on the same port and data
            back = len(out)
            wait_until(lambda: any(s == 200 for s, _, _ in out[back:]), 60)
            ok = max(i for i, (s, _, _) in enumerate(out) if s == 200)
            wait_until(lambda: len(out) > ok + 20, 60)
            late = [(s, b) for s, _, b in out[ok + 5 :] if s != 200]
            assert not late, late[:3]
        finally:
            stop.set()
            loader.join()
            stoppable.stop()
    assert {s for s, _, _ in out} == {200, 503}
    for status, retry, body in out:
        if status == 503:
            assert retry is not None
            assert body["error_type"] in ("backend_unavailable", "deadline_exceeded"), body
            assert "Milvus" in body["error"] or "took longer" in body["error"]


@pytest.fixture(scope="module")
def auth_root(tmp_path_factory, milvus_auth) -> tuple[Path, Path, str]:
    """A root built into the Milvus that checks tokens, with its token: (root, model, version)."""
    tmp = tmp_path_factory.mktemp("auth")
    model = make_model_dir(tmp / "model")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TOKEN_ENV, milvus_auth.token)
        v1 = build_index(tmp / "root", model, records_v("v1", 100), tmp, "--backend", "milvus",
                         "--milvus-uri", milvus_auth.uri, "--views", "a")  # fmt: skip
    return tmp / "root", model, v1


def test_a_milvus_that_checks_tokens_takes_the_right_one_and_names_a_wrong_one(
    tmp_path, milvus_auth, auth_root, monkeypatch
) -> None:
    root, model, v1 = auth_root
    monkeypatch.setenv(TOKEN_ENV, "root:Milvus")
    body = {"query": {"a": [0.1] * 6}, "k": 3}
    with running(settings_for(root)) as client:
        assert client.get("/readyz").json()["index_version"] == v1
        assert len(search(client, body)["results"]) == 3
    records = tmp_path / "more.jsonl"
    write_jsonl(records, records_v("v2", 20))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model),
           "--records", str(records), "--root", str(root), "--quiet"]  # fmt: skip
    said = {
        "root:wrong": f"cannot connect: it refused the token in {TOKEN_ENV} (UNAUTHENTICATED: ",
        "": f"cannot connect: it wants a token: set {TOKEN_ENV} (user:password, or an API key)",
    }
    for token, words in said.items():
        done = subprocess.run(cmd, env=env | {TOKEN_ENV: token}, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith(f"hclip index build: error: Milvus at {milvus_auth.uri}: "), line
        assert words in line, line
    assert (root / "CURRENT").read_text().strip() == v1
    monkeypatch.setenv(TOKEN_ENV, "root:wrong")  # a server given the wrong token
    with running(settings_for(root), wait_ready=False) as client:
        wait_until(lambda: client.get("/readyz").status_code == 503, 30)
        ready = client.get("/readyz").json()
        assert f"it refused the token in {TOKEN_ENV}" in ready["error"], ready
        r = client.post("/v1/search", json=body)
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready", r.text
        assert f"it refused the token in {TOKEN_ENV} (UNAUTHENTICATED: " in r.json()["error"]


def test_milvus_standalone_stopped_is_answered_503_in_the_services_words(
    milvus_auth, auth_root, monkeypatch
) -> None:
    """Stops the module's Milvus that checks tokens: the last of its tests."""
    root, _, _ = auth_root
    monkeypatch.setenv(TOKEN_ENV, milvus_auth.token)
    body = {"query": {"a": [0.1] * 6}, "k": 3}
    with running(settings_for(root, milvus_timeout_s=2.0)) as client:
        assert len(search(client, body)["results"]) == 3
        milvus_auth.stop()
        r = client.post("/v1/search", json={"query": {"a": [0.2] * 6}, "k": 3})
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert r.json()["error_type"] == "backend_unavailable", r.text
        assert (
            r.json()["error"] == "the vector database (Milvus) is unreachable or refused the call"
        )
        assert client.post("/v1/search", json=body).status_code == 200  # cached still answers
        wait_until(lambda: client.get("/readyz").status_code == 503, 30)
        assert f"Milvus at {milvus_auth.uri}" in client.get("/readyz").json()["error"]


def test_a_killed_build_leaves_current_and_its_collections_are_dropped_next(tmp_path) -> None:
    milvus_lite = Lite(tmp_path / "milvus")
    milvus_lite.start()
    try:
        killed_build(tmp_path, milvus_lite.uri)
    finally:
        milvus_lite.stop()


def killed_build(tmp_path: Path, milvus: str) -> None:
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "root"
    v1 = build_index(root, model, records_v("v1"), tmp_path, "--backend", "milvus",
                     "--milvus-uri", milvus)  # fmt: skip
    prefix = json.loads((root / "backend.json").read_text())["prefix"]
    client = pymilvus.MilvusClient(uri=milvus)
    published = {c for c in client.list_collections() if c.startswith(prefix)}
    assert len(published) == 7  # records and six views
    big = tmp_path / "big.jsonl"
    write_jsonl(big, records_v("v2", 3_000, seed=2))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    job = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model), "--records",
         str(big), "--root", str(root), "--quiet"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def partial() -> bool:
        return bool({c for c in client.list_collections() if c.startswith(prefix)} - published)

    try:
        wait_until(partial, 120)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    assert (root / "CURRENT").read_text().strip() == v1
    with running(settings_for(root)) as served:
        assert served.get("/v1/info").json()["index_version"] == v1
    assert partial()  # the dead job's collections are still there ...
    assert run_cli("index", "gc", "--root", root, "--keep", "3") == 0
    left = {c for c in client.list_collections() if c.startswith(prefix)}
    assert left == published  # ... until the next job under the root lock drops them
    assert run_cli("index", "verify", "--root", root) == 0
    # gc drops the collections of the versions it removes, and verify sees a missing one.
    v2 = build_index(root, model, records_v("v2", 50, seed=4), tmp_path)
    assert run_cli("index", "gc", "--root", root, "--keep", "1") == 0
    left = {c for c in client.list_collections() if c.startswith(prefix)}
    assert len(left) == 7 and all(v2.replace("-", "_") in c for c in left), left
    client.drop_collection(sorted(left)[0])
    assert run_cli("index", "verify", "--root", root) == 1


# -- ready means able to answer, on Milvus -------------------------------------------------------


def test_milvus_restarted_without_its_data_is_not_ready_and_says_why(tmp_path) -> None:
    model = make_model_dir(tmp_path / "model")
    root, port = tmp_path / "root", free_port()
    with milvus_server(tmp_path / "milvus", port) as (uri, proc):
        v1 = build_index(root, model, records_v("v1", 100), tmp_path, "--backend", "milvus",
                         "--milvus-uri", uri)  # fmt: skip
        settings = settings_for(root, milvus_timeout_s=2.0, reload_retry_s=0.2)
        with running(settings) as client:
            assert client.get("/readyz").json()["index_version"] == v1
            body = {"query": {"a": [0.1] * 6}, "k": 3}
            assert client.post("/v1/search", json=body).status_code == 200
            proc.kill()  # Milvus goes; one comes back on its address with nothing in it
            proc.wait()
            with milvus_server(tmp_path / "empty", port):  # the same address, no data

                def says_gone() -> bool:
                    r = client.get("/readyz")
                    return r.status_code == 503 and "cannot be served" in r.json()["error"]

                wait_until(says_gone, 30)  # once the client has reconnected
                ready = client.get("/readyz").json()
                assert f"version {v1} cannot be served" in ready["error"], ready
                assert "no longer holds its collection" in ready["error"] or (
                    "has no collection" in ready["error"]
                ), ready
                body = {"query": {"a": [0.2] * 6}, "k": 3}  # not cached
                r = client.post("/v1/search", json=body)
                assert r.status_code == 503 and r.json()["error_type"] == "not_ready", r.text
                assert v1 in r.json()["error"]


def test_a_hung_milvus_is_answered_in_the_services_own_words(tmp_path) -> None:
    model = make_model_dir(tmp_path / "model")
    root = tmp_path / "root"
    with milvus_server(tmp_path / "milvus") as (uri, proc):
        build_index(root, model, records_v("v1", 100), tmp_path, "--backend", "milvus",
                    "--milvus-uri", uri)  # fmt: skip
        settings = settings_for(root, milvus_timeout_s=1.0, request_timeout_s=10.0)
        with running(settings) as client:
            proc.send_signal(signal.SIGSTOP)
            try:
                r = client.post("/v1/search", json={"query": {"a": [0.3] * 6}, "k": 3})
                assert r.status_code == 503, r.text
                error = r.json()["error"]
                assert r.json()["error_type"] == "backend_unavailable", r.text
                assert error == "the vector database (Milvus) did not answer within 1 s", error
                ready = client.get("/readyz")
                assert ready.status_code == 503 and "_InactiveRpcError" not in ready.text
            finally:
                proc.send_signal(signal.SIGCONT)
            wait_until(lambda: client.get("/readyz").status_code == 200, 20)


def test_verify_loads_a_collection_a_restart_released(tmp_path, capsys) -> None:
    model = make_model_dir(tmp_path / "model")
    root, data, port = tmp_path / "root", tmp_path / "milvus", free_port()
    with milvus_server(data, port) as (uri, _):
        build_index(root, model, records_v("v1", 100), tmp_path, "--backend", "milvus",
                    "--milvus-uri", uri)  # fmt: skip
    with milvus_server(data, port):  # back with its data, every collection released
        assert run_cli("index", "verify", "--root", root) == 0, capsys.readouterr().out


def test_a_milvus_lite_path_with_more_than_one_worker_is_refused_at_start(tmp_path) -> None:
    from indexer.store import milvus

    root = tmp_path / "root"
    root.mkdir()
    milvus.write_root(root, "milvus", str(tmp_path / "milvus.db"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--root", str(root), "--port",
           str(free_port())]  # fmt: skip
    done = subprocess.run([*cmd, "--workers", "2"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("hclip serve: error: ") and "milvus.db" in line, done.stderr
    assert "--workers 1" in line and "HCLIP_MILVUS_URI" in line
    env["HCLIP_MILVUS_URI"] = str(tmp_path / "other.db")  # the setting, over the root's
    done = subprocess.run([*cmd, "--workers", "3"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2 and "other.db" in done.stderr, done.stderr
