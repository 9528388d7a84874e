"""Search over HTTP equals the brute-force reference; the cache; reloads never mix versions."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from indexer.store import artifact
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.app.conftest import (
    build_index,
    free_port,
    private_redis,
    records_v,
    running,
    settings_for,
    wait_until,
)


def reference(version: LoadedVersion, model, query: dict[str, list[float]], k: int):
    """docs/design.md §1 from the stored embeddings in numpy: (ids, scores) best first."""
    q_names = sorted(query)
    t_names = [n for n in version.names if n not in query]
    with torch.no_grad():
        q_emb = {
            n: model.encode(n, [torch.tensor(v, dtype=torch.float32)])[0].numpy()
            for n, v in query.items()
        }
    omega = model.head.omega.detach().numpy()
    qv = omega * np.prod([q_emb[n] for n in q_names], axis=0)
    ids, scores = [], []
    for row, rec in enumerate(version.records):
        if all(n in rec["modalities"] for n in t_names):
            rv = np.prod([np.asarray(version.stored.embeddings[n][row]) for n in t_names], axis=0)
            ids.append(rec["id"])
            scores.append(float(qv @ rv))
    order = np.argsort(-np.array(scores), kind="stable")[:k]
    return [ids[i] for i in order], [scores[i] for i in order]


def test_results_equal_the_reference_for_every_view(vector_index) -> None:
    root, model_dir, rows = vector_index
    version = LoadedVersion(artifact.current_version_dir(root))
    model = load_model(model_dir)
    with running(settings_for(root)) as client:
        for view in version.views.values():
            for probe in rows[5:8]:
                query = {n: probe[n] for n in view.query if n in probe}
                if len(query) < len(view.query):
                    continue
                r = client.post("/v1/search", json={"query": query, "k": 7})
                assert r.status_code == 200, r.text
                body = r.json()
                want_ids, want_scores = reference(version, model, query, 7)
                assert body["view"] == view.name and body["index_version"] == version.version
                assert [x["id"] for x in body["results"]] == want_ids
                assert np.allclose([x["score"] for x in body["results"]], want_scores, atol=1e-4)
                assert body["results"][0]["payload"]["version_tag"] == "v1"
                # the same query as precomputed embeddings gives the same answer
                emb = client.post(
                    "/v1/embed", json={"modality": view.query[0], "inputs": [query[view.query[0]]]}
                ).json()
                mixed = {
                    "query": {n: query[n] for n in view.query[1:]},
                    "embeddings": {view.query[0]: emb["embeddings"][0]},
                    "k": 7,
                }
                again = client.post("/v1/search", json=mixed).json()
                assert [x["id"] for x in again["results"]] == want_ids


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_second_identical_request_is_served_from_the_cache(vector_index, backend: str) -> None:
    root, _, rows = vector_index
    extra = {"redis_url": "redis://127.0.0.1:6379/0"} if backend == "redis" else {}
    with running(settings_for(root, **extra)) as client:
        assert client.get("/v1/info").json()["cache"] == backend
        body = {"query": {"a": rows[1]["a"]}, "k": 5}
        first = client.post("/v1/search", json=body).json()
        second = client.post("/v1/search", json={"k": 5, "query": {"a": rows[1]["a"]}}).json()
        assert first["cached"] is False and second["cached"] is True
        assert first["results"] == second["results"]
        metrics = client.get("/metrics").text
        assert 'hclip_cache_total{kind="result",outcome="hit"} 1.0' in metrics


def test_with_the_cache_off_nothing_is_kept_or_counted(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root, cache_max_bytes=0)) as client:
        assert client.get("/v1/info").json()["cache"] == "off"
        body = {"query": {"a": rows[1]["a"]}, "k": 5}
        first, second = (client.post("/v1/search", json=body).json() for _ in range(2))
        assert first["cached"] is False and second["cached"] is False
        assert first["results"] == second["results"] and len(first["results"]) == 5
        batch = client.post("/v1/search/batch", json={"queries": [body, body]}).json()
        for answer in batch["results"]:  # batched with each other: the same ids, scores to 1e-5
            assert [x["id"] for x in answer["results"]] == [x["id"] for x in first["results"]]
            assert np.allclose(
                [x["score"] for x in answer["results"]], [x["score"] for x in first["results"]],
                atol=1e-5,
            )  # fmt: skip
        metrics = client.get("/metrics").text
        assert 'hclip_cache_total{kind="result",outcome="miss"} 0.0' in metrics


def test_new_version_is_picked_up_and_responses_never_mix_versions(
    tmp_path: Path, vector_index
) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = build_index(root, model_dir, records_v("v1"), tmp_path)
    seen: dict[str, int] = {}
    errors: list[str] = []
    stop = threading.Event()
    probe = records_v("x", n=20, seed=5)

    with running(settings_for(root, redis_url="redis://127.0.0.1:6379/0")) as client:

        def hammer(i: int) -> None:
            while not stop.is_set():
                r = client.post("/v1/search", json={"query": {"b": probe[i % 20]["b"]}, "k": 10})
                if r.status_code != 200:
                    errors.append(r.text)
                    continue
                body = r.json()
                tag = "v1" if body["index_version"] == v1 else "v2"
                seen[tag] = seen.get(tag, 0) + 1
                tags = {x["payload"]["version_tag"] for x in body["results"]}
                if tags != {tag}:
                    errors.append(f"{body['index_version']} served {tags}")

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(hammer, i) for i in range(4)]
            wait_until(lambda: seen.get("v1", 0) > 20)
            v2 = build_index(root, model_dir, records_v("v2", seed=1), tmp_path)
            wait_until(lambda: client.get("/readyz").json()["index_version"] == v2)
            wait_until(lambda: seen.get("v2", 0) > 20)
            stop.set()
            for f in futures:
                f.result()
        assert not errors, errors[:3]
        info = client.get("/v1/info").json()
        assert info["index_version"] == v2 and info["parent_version"] == v1
        assert f'hclip_index_version_info{{version="{v2}"}} 1.0' in client.get("/metrics").text


def test_stopping_redis_mid_test_produces_no_5xx(vector_index) -> None:
    root, _, rows = vector_index
    port = free_port()
    settings = settings_for(root, redis_url=f"redis://127.0.0.1:{port}/0", redis_retry_s=0.2)
    with private_redis(port) as proc, running(settings) as client:

        def search(i: int) -> dict:
            r = client.post("/v1/search", json={"query": {"a": rows[i]["a"]}, "k": 3})
            assert r.status_code == 200, r.text
            return r.json()

        search(1)
        assert search(1)["cached"] is True
        proc.kill()
        proc.wait()
        for i in range(30):
            assert search(i % 5)["cached"] is False
        assert "hclip_cache_errors_total 0.0" not in client.get("/metrics").text
        with private_redis(port):  # Redis comes back on the same port: so does the cache
            wait_until(lambda: search(2)["cached"] is True, timeout=10)
        assert redis.Redis(port=6379).ping()


@pytest.mark.parametrize("head", ["hclip", "symile", "sum_of_pairs"])
def test_the_served_query_factor_is_the_heads_bit_for_bit(tmp_path: Path, head: str) -> None:
    """The service computes a batch's query factors by calling the head (app.services.batching
    query_factors), so every score is the one the model defines, whatever the batch."""
    import asyncio
    import itertools

    from app.services.batching import SearchItem, query_factors
    from tests.conftest import DIMS, make_model_dir

    root = tmp_path / "root"
    model_dir = make_model_dir(tmp_path / "model", head=head)
    rows = records_v("q", n=40)
    build_index(root, model_dir, rows, tmp_path)
    model = load_model(model_dir)
    from app.main import create_app

    app = create_app(settings_for(root))

    async def factors() -> None:
        async with app.router.lifespan_context(app):
            state = app.state.hclip
            while state.versions.current is None:
                await asyncio.sleep(0.02)
            serving = state.versions.current
            rng = np.random.default_rng(4)
            for r in (1, 2):
                for names in itertools.combinations(sorted(DIMS), r):
                    view = serving.index.views["+".join(names)]
                    given = [
                        {n: rng.standard_normal(8).astype(np.float32) for n in names}
                        for _ in range(3)
                    ]
                    got = query_factors(serving.model.head, view, [SearchItem(g, 5) for g in given])
                    for i, g in enumerate(given):
                        with torch.no_grad():
                            batch = {n: torch.from_numpy(v)[None] for n, v in g.items()}
                            want = model.head.query_factor(batch, names)
                        assert np.array_equal(got[i], want[0].numpy()), (head, names)

    asyncio.run(factors())
