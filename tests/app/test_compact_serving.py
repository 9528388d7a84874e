"""A compact version served over HTTP: exact float16 scores, filters, its stored embeddings,
what /v1/info says each view stores, and the re-ranking setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from app.core.settings import Settings
from indexer.store import artifact
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.app.conftest import build_index, records_v, running, settings_for
from tests.conftest import make_model_dir


@pytest.fixture(scope="module")
def compact_index(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("compact-serving")
    model = make_model_dir(tmp / "model")
    rows = records_v("v1")  # every 10th record lacks `c`: views of c hold their own rows
    build_index(tmp / "root", model, rows, tmp, "--compact", "--filter-fields", "symbol")
    return tmp / "root", model, rows


def reference(version: LoadedVersion, model, query: dict[str, list[float]], allowed=None):
    """Every record's exact score from the stored float16 embeddings, in float64:
    {id: omega . prod q . prod g_t}."""
    t_names = [n for n in version.names if n not in query]
    with torch.no_grad():
        q = {n: model.encode(n, [torch.tensor(v)])[0].double().numpy() for n, v in query.items()}
    qv = model.head.omega.detach().double().numpy() * np.prod(list(q.values()), axis=0)
    out = {}
    for row, rec in enumerate(version.records):
        if all(n in rec["modalities"] for n in t_names) and (allowed is None or allowed(rec)):
            prod = np.prod(
                [version.stored.embeddings[n][row].astype(np.float64) for n in t_names], 0
            )
            out[rec["id"]] = float(qv @ prod)
    return out


def _check(results: list[dict], want: dict[str, float], k: int) -> None:
    """The k best by the reference, but for neighbours tied within 1e-5 at the k-th place;
    every score the reference's within float32 rounding."""
    best = sorted(want.values(), reverse=True)
    assert len(results) == min(k, len(want))
    for hit in results:
        assert hit["score"] == pytest.approx(want[hit["id"]], rel=1e-5, abs=1e-6)
        assert want[hit["id"]] >= best[len(results) - 1] - 1e-5


def test_compact_search_scores_are_exact_with_and_without_filters(compact_index) -> None:
    root, model_dir, rows = compact_index
    version = LoadedVersion(artifact.current_version_dir(root))
    model = load_model(model_dir)
    flt = {"symbol": {"in": [1, 2, 3]}}
    with running(settings_for(root)) as client:
        info = client.get("/v1/info").json()
        stores = {v["query"][0] if len(v["query"]) == 1 else "+".join(v["query"]): v["stores"]
                  for v in info["views"].values()}  # fmt: skip
        assert stores == {"a": "codes:SQ8", "b": "codes:SQ8", "c": "codes:SQ8",
                          "b+c": "float16", "a+c": "float16", "a+b": "float16"}  # fmt: skip
        for view in version.views.values():
            for probe in rows[11:14]:
                query = {n: probe[n] for n in view.query}
                body = client.post("/v1/search", json={"query": query, "k": 10}).json()
                assert body["view"] == view.name and "effort" not in body  # codes: no effort
                _check(body["results"], reference(version, model, query), 10)
                body = client.post("/v1/search", json={"query": query, "k": 10, "filter": flt})
                hits = body.json()["results"]
                assert {h["payload"]["symbol"] for h in hits} <= {1, 2, 3}
                allowed = reference(
                    version, model, query, lambda r: r["payload"]["symbol"] in flt["symbol"]["in"]
                )
                _check(hits, allowed, 10)


def test_the_embeddings_endpoint_returns_the_float16_embeddings(compact_index) -> None:
    root, _, rows = compact_index
    version = LoadedVersion(artifact.current_version_dir(root))
    with running(settings_for(root)) as client:
        for rid in (rows[0]["id"], rows[7]["id"]):  # rows[0] lacks c
            body = client.get(f"/v1/records/{rid}/embeddings").json()
            row = version.records.row_of(rid)
            assert row is not None
            assert set(body["embeddings"]) == set(version.records[row]["modalities"])
            for n, got in body["embeddings"].items():
                want = version.stored.embeddings[n][row]
                assert want.dtype == np.float16
                assert np.array_equal(np.asarray(got, np.float32), want.astype(np.float32))
        assert "c" not in client.get(f"/v1/embeddings?id={rows[0]['id']}").json()["embeddings"]


def test_rerank_factor_is_a_setting(monkeypatch) -> None:
    monkeypatch.setenv("HCLIP_RERANK_FACTOR", "25")
    assert Settings().rerank_factor == 25
    monkeypatch.setenv("HCLIP_RERANK_FACTOR", "-1")
    with pytest.raises(ValidationError, match="rerank_factor"):
        Settings()
