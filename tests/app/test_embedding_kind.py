"""A model over the user's own embeddings, trained, indexed and served through the CLI and HTTP.

Only the command line and the HTTP API are used here, as a user would use them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.app.conftest import running, settings_for
from tests.conftest import index_build, run_cli, vector_records, write_jsonl

# The user's towers give 12-d, 8-d and 6-d embeddings; b's are used as they are (d = 8), a's
# and c's go through learned linear maps.
DIMS = {"a": 12, "b": 8, "c": 6}
MODALITIES = {
    "a": {"kind": "embedding", "dim": 12, "map": "linear"},
    "b": {"kind": "embedding", "dim": 8},
    "c": {"kind": "embedding", "dim": 6, "map": "linear"},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("embedding-kind")
    rows = vector_records(400, DIMS, seed=3, k=20)
    write_jsonl(tmp / "records.jsonl", rows)
    cfg = {
        "modalities": MODALITIES,
        "latent_dim": 8,
        "train": {"records": "records.jsonl", "epochs": 40, "batch_size": 64, "lr": 0.02},
    }
    (tmp / "config.json").write_text(json.dumps(cfg))
    assert run_cli("train", "--config", tmp / "config.json", "--out", tmp / "model", "--quiet") == 0
    assert index_build(tmp / "model", tmp / "records.jsonl", tmp / "root") == 0
    return tmp / "root", rows


def search(client, body: dict) -> dict:
    r = client.post("/v1/search", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_searches_by_raw_embeddings_find_the_symbol(served) -> None:
    root, rows = served
    symbol = {r["id"]: r["payload"]["symbol"] for r in rows}
    with running(settings_for(root)) as client:
        info = client.get("/v1/info").json()
        assert info["model"]["modalities"] == {m: "embedding" for m in DIMS}
        hits = []
        for probe in rows[:30]:
            for query in ({"a": probe["a"]}, {"b": probe["b"], "c": probe["c"]}):
                out = search(client, {"query": query, "k": 5})
                assert out["view"] == "+".join(sorted(query))
                hits.append(symbol[out["results"][0]["id"]] == probe["payload"]["symbol"])
    assert np.mean(hits) >= 0.9, np.mean(hits)


def test_embeddings_given_directly_equal_raw_queries(served) -> None:
    """An unmapped embedding is only L2-normalised: its unit vector, sent as `embeddings`,
    is the same query as the raw vector sent as `query`."""
    root, rows = served
    with running(settings_for(root)) as client:
        for probe in rows[40:45]:
            raw = np.asarray(probe["b"])
            unit = (raw / np.linalg.norm(raw)).tolist()
            embedded = client.post("/v1/embed", json={"modality": "b", "inputs": [probe["b"]]})
            assert embedded.status_code == 200, embedded.text
            assert np.allclose(embedded.json()["embeddings"][0], unit, atol=1e-6)
            by_raw = search(client, {"query": {"b": probe["b"]}, "k": 10})
            by_emb = search(client, {"embeddings": {"b": unit}, "k": 10})
            assert [r["id"] for r in by_raw["results"]] == [r["id"] for r in by_emb["results"]]
            assert np.allclose(
                [r["score"] for r in by_raw["results"]],
                [r["score"] for r in by_emb["results"]],
                rtol=1e-5,
            )
            mixed = search(client, {"query": {"a": probe["a"]}, "embeddings": {"b": unit}})
            assert mixed["view"] == "a+b"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"a": [1.0, 2.0]}, "embedding must have length 12, got 2"),
        ({"b": [0.0] * 8}, "all zeros"),
        ({"b": "seven"}, "embedding must be a list of numbers"),
    ],
)
def test_bad_embeddings_are_client_errors(served, query: dict, message: str) -> None:
    root, _ = served
    with running(settings_for(root)) as client:
        r = client.post("/v1/search", json={"query": query})
        assert 400 <= r.status_code < 500 and message in r.json()["error"], r.text
