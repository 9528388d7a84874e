"""Payload filters against a brute-force reference, for exact and approximate views; batches of
searches equal the same searches one by one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from indexer.store import artifact
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.app.conftest import build_index, running, settings_for
from tests.app.test_search import reference
from tests.conftest import DIMS, vector_records


def rows_with_fields(n: int = 400) -> list[dict]:
    rows = vector_records(n, DIMS, seed=4, k=60)
    for i, r in enumerate(rows):
        r["payload"] = {"category": f"c{i % 5}", "year": 1990 + i % 30, "flag": i % 2 == 0}
        if i % 7 == 0:
            del r["payload"]["year"]  # missing: matches no condition on year
        if i % 11 == 0:
            r["payload"]["category"] = 3  # a categorical field may hold numbers too
    return rows


@pytest.fixture(scope="module", params=["flat", "hnsw:M=16,ef_search=32"])
def filtered(request, tmp_path_factory, vector_index):
    _, model_dir, _ = vector_index
    tmp = tmp_path_factory.mktemp("filters")
    rows = rows_with_fields()
    fields = ("--filter-fields", "category,year,flag")
    build_index(tmp / "root", model_dir, rows, tmp, *fields, "--spec", request.param)
    return tmp / "root", model_dir, rows


def matches(payload: dict, flt: dict) -> bool:
    for name, cond in flt.items():
        v = payload.get(name)
        if v is None:
            return False
        if isinstance(cond, dict) and "in" in cond:
            if not any((v == w and type(v) is type(w)) or (_num(v) and _num(w) and v == w)
                       for w in cond["in"]):  # fmt: skip
                return False
        elif isinstance(cond, dict):
            ops = {"gt": v.__gt__, "gte": v.__ge__, "lt": v.__lt__, "lte": v.__le__}
            if not _num(v) or not all(ops[op](bound) for op, bound in cond.items()):
                return False
        elif not (v == cond and (type(v) is type(cond) or (_num(v) and _num(cond)))):
            return False
    return True


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


FILTERS = [
    {"category": "c2"},
    {"category": {"in": ["c1", "c4", 3]}},
    {"year": {"gte": 2000, "lt": 2005}},
    {"flag": True, "year": {"lte": 1995}},
    {"category": "c3", "year": 2011},  # fewer matches than k
    {"category": "no-such-value"},  # none
]


@pytest.mark.parametrize("flt", FILTERS, ids=[str(f) for f in FILTERS])
def test_filtered_search_equals_the_brute_force_reference(filtered, flt: dict) -> None:
    root, model_dir, rows = filtered
    version = LoadedVersion(artifact.current_version_dir(root))
    model = load_model(model_dir)
    allowed = {r["id"] for r in rows if matches(r["payload"], flt)}
    k = 15
    with running(settings_for(root)) as client:
        for probe in rows[:6]:
            query = {"a": probe["a"]}
            r = client.post("/v1/search", json={"query": query, "k": k, "filter": flt})
            assert r.status_code == 200, r.text
            body = r.json()
            ids, scores = reference(version, model, query, len(rows))
            want = [(i, s) for i, s in zip(ids, scores, strict=True) if i in allowed][:k]
            got = [(h["id"], h["score"]) for h in body["results"]]
            assert len(got) == len(want) == min(k, len([i for i in ids if i in allowed]))
            true = dict(zip(ids, scores, strict=True))
            for hit_id, score in got:  # every score is the record's exact score
                assert hit_id in allowed and abs(true[hit_id] - score) < 1e-4
            if version.views["a"].spec.exact:
                assert [g[0] for g in got] == [w[0] for w in want]
            else:  # approximate: most of the true top k, never a record the filter excludes
                overlap = len({g[0] for g in got} & {w[0] for w in want})
                assert overlap >= 0.8 * len(want), (overlap, len(want))
            for hit in body["results"]:
                assert matches(hit["payload"], flt)


def test_bad_filters_are_clear_422s(filtered) -> None:
    root, _, rows = filtered
    q = {"a": rows[0]["a"]}
    cases = [
        ({"price": 3}, "filter.price: not a filterable field (declared: category, year, flag)"),
        ({"category": {"gte": 1}}, "filter.category: a range needs a numeric field"),
        ({"year": "x"}, "filter.year: year is a numeric field; compare it to numbers"),
        ({"year": {"between": [1, 2]}}, "filter.year: fits none of its accepted forms"),
        ({"year": [1, 2]}, "filter.year: fits none of its accepted forms"),
        ({"year": {}}, "filter.year: fits none of its accepted forms"),
    ]
    with running(settings_for(root)) as client:
        for flt, message in cases:
            r = client.post("/v1/search", json={"query": q, "filter": flt})
            assert r.status_code == 422, (flt, r.text)
            assert message in r.json()["error"], (flt, r.json()["error"])


def test_filtered_results_are_cached_per_filter(filtered) -> None:
    root, _, rows = filtered
    q = {"a": rows[1]["a"]}
    with running(settings_for(root)) as client:
        a1 = client.post("/v1/search", json={"query": q, "filter": {"category": "c1"}}).json()
        b1 = client.post("/v1/search", json={"query": q, "filter": {"category": "c2"}}).json()
        a2 = client.post("/v1/search", json={"filter": {"category": "c1"}, "query": q}).json()
        plain = client.post("/v1/search", json={"query": q}).json()
    assert a1["cached"] is False and b1["cached"] is False and plain["cached"] is False
    assert a2["cached"] is True and a2["results"] == a1["results"]
    assert {h["payload"]["category"] for h in b1["results"]} == {"c2"}


def test_a_batch_equals_the_same_searches_one_by_one(filtered) -> None:
    root, _, rows = filtered
    queries = [{"query": {"a": rows[i]["a"]}, "k": 3 + i % 4} for i in range(10)] + [
        {"query": {"b": rows[3]["b"], "c": rows[3]["c"]}, "filter": {"flag": False}},
        {"embeddings": {"a": [0.0] * 8}, "k": 2},
    ]
    with running(settings_for(root)) as one_by_one:
        alone = [one_by_one.post("/v1/search", json=q) for q in queries]
    with running(settings_for(root)) as client:  # a fresh cache: nothing answered from it
        r = client.post("/v1/search/batch", json={"queries": queries})
        assert r.status_code == 200, r.text
        batch = r.json()["results"]
        metrics = client.get("/metrics").text
    assert len(batch) == len(queries)
    for got, want in zip(batch, alone, strict=True):
        w = want.json()
        assert [h["id"] for h in got["results"]] == [h["id"] for h in w["results"]]
        assert np.allclose([h["score"] for h in got["results"]],
                           [h["score"] for h in w["results"]], atol=1e-5)  # fmt: skip
        assert got["view"] == w["view"] and got["cached"] is False
    # the batch's queries went through the search batcher together
    assert 'hclip_search_batch_size_bucket{le="1.0"}' in metrics


def test_batch_limits_and_an_invalid_query(filtered) -> None:
    root, _, rows = filtered
    with running(settings_for(root, max_batch_queries=3)) as client:
        too_many = [{"query": {"a": rows[0]["a"]}}] * 4
        r = client.post("/v1/search/batch", json={"queries": too_many})
        assert r.status_code == 422 and "HCLIP_MAX_BATCH_QUERIES" in r.json()["error"]
        assert client.post("/v1/search/batch", json={"queries": []}).status_code == 422
        bad = [{"query": {"a": rows[0]["a"]}}, {"query": {"smell": "roses"}}]
        r = client.post("/v1/search/batch", json={"queries": bad})
        assert r.status_code == 422  # an invalid body, like any other
        assert r.json()["error"].startswith("queries[1].query.smell: unknown modality")
        every = {"query": {"a": rows[1]["a"], "b": rows[1]["b"], "c": rows[1]["c"]}}
        r = client.post("/v1/search/batch", json={"queries": [bad[0], every]})
        assert r.status_code == 400 and "queries[1].the query names every" in r.json()["error"]


def test_an_undecodable_input_fails_only_its_query_in_a_batch(tmp_path: Path) -> None:
    from tests.app.test_hostile import GOOD, MALFORMED, media_model
    from tests.models.test_inputs import data_uri

    root = tmp_path / "root"
    rows = [{"id": f"g{i}", "image": GOOD["image"](i), "vec": [i, 1, 2]} for i in range(20)]
    build_index(root, media_model(tmp_path, {"image", "vec"}), rows, tmp_path)
    bad = data_uri("image/png", MALFORMED["image"]["not an image"]())
    queries = [{"query": {"image": GOOD["image"](50)}}, {"query": {"image": bad}}]
    with running(settings_for(root)) as client:
        r = client.post("/v1/search/batch", json={"queries": queries})
    assert r.status_code == 200, r.text
    ok, failed = r.json()["results"]
    assert len(ok["results"]) == 10 and failed["status"] == 422
    assert failed["error"].startswith("query.image: image could not be decoded")


def test_undeclared_filters_on_an_index_without_fields(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root)) as client:
        r = client.post("/v1/search", json={"query": {"a": rows[0]["a"]}, "filter": {"x": 1}})
    assert r.status_code == 422
    assert "filter.x: not a filterable field (declared: none were declared" in r.json()["error"]


def test_filter_fields_survive_an_update(tmp_path: Path, vector_index) -> None:
    from tests.conftest import run_cli, write_jsonl

    _, model_dir, _ = vector_index
    rows = rows_with_fields(60)
    build_index(tmp_path / "root", model_dir, rows, tmp_path, "--filter-fields", "category")
    new = [dict(rows[0], id="new-1", payload={"category": "fresh"})]
    write_jsonl(tmp_path / "up.jsonl", new)
    args = ["index", "update", "--root", tmp_path / "root", "--upsert", tmp_path / "up.jsonl"]
    assert run_cli(*args, "--quiet") == 0
    with running(settings_for(tmp_path / "root")) as client:
        r = client.post(
            "/v1/search", json={"query": {"a": rows[0]["a"]}, "filter": {"category": "fresh"}}
        ).json()
    assert [h["id"] for h in r["results"]] == ["new-1"]
