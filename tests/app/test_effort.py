"""Per-request search effort over HTTP: bounded by HCLIP_MAX_EFFORT, reported in the response,
and it changes what an approximate view returns, for every approximate family."""

from __future__ import annotations

from pathlib import Path

import pytest

from indexer.store import artifact
from indexer.store.version import LoadedVersion
from models.checkpoint import load_model
from tests.app.conftest import build_index, running, settings_for
from tests.app.test_search import reference
from tests.conftest import DIMS, make_model_dir, vector_records

MAX_EFFORT = 64
SPECS = [  # effort = nprobe for every inverted file; at nprobe = nlist all lists are probed
    "ivf:nlist=32,nprobe=4",
    "ivfip:nlist=32,nprobe=4",
    "ivfpq:nlist=32,m=3,nbits=8,nprobe=4,rerank=20",
    "ivfsq:nlist=32,nprobe=4,rerank=4",
]


@pytest.fixture(scope="module", params=SPECS)
def approximate(request, tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("effort")
    model = make_model_dir(tmp / "model")
    rows = vector_records(2500, DIMS, seed=8, k=400)
    build_index(tmp / "root", model, rows, tmp, "--spec", request.param, "--views", "a")
    return tmp / "root", model, rows


def test_effort_over_the_bound_is_a_422(approximate) -> None:
    root, _, rows = approximate
    q = {"query": {"a": rows[0]["a"]}}
    with running(settings_for(root, max_effort=MAX_EFFORT)) as client:
        r = client.post("/v1/search", json=q | {"effort": MAX_EFFORT + 1})
        assert r.status_code == 422, r.text
        assert (
            f"must be between 1 and {MAX_EFFORT} (HCLIP_MAX_EFFORT), got {MAX_EFFORT + 1}" in r.text
        )
        batch = {"queries": [q, q | {"effort": MAX_EFFORT + 1}]}
        r = client.post("/v1/search/batch", json=batch)
        assert r.status_code == 422 and "queries[1].effort" in r.json()["error"], r.text
        assert client.post("/v1/search", json=q | {"effort": MAX_EFFORT}).status_code == 200


def test_effort_within_the_bound_is_used_and_reported(approximate) -> None:
    root, model_dir, rows = approximate
    version = LoadedVersion(artifact.current_version_dir(root))
    model = load_model(model_dir)
    default = version.views["a"].default_effort
    assert default == 4
    changed = 0
    with running(settings_for(root, max_effort=MAX_EFFORT)) as client:
        for probe in rows[:12]:
            q = {"query": {"a": probe["a"]}, "k": 10}
            plain = client.post("/v1/search", json=q).json()
            low = client.post("/v1/search", json=q | {"effort": 1}).json()
            full = client.post("/v1/search", json=q | {"effort": 32}).json()
            assert (plain["effort"], low["effort"], full["effort"]) == (default, 1, 32)
            all_ids, all_scores = reference(version, model, q["query"], len(rows))
            ids, true = all_ids[:10], dict(zip(all_ids, all_scores, strict=True))
            for body in (plain, low, full):  # every score is the record's exact score
                for hit in body["results"]:
                    assert abs(true[hit["id"]] - hit["score"]) < 1e-4
            found = [h["id"] for h in full["results"]]
            # every list probed: the exact top 10 (re-ranked codes may miss a near tie)
            assert len(set(found) & set(ids)) >= 9, (found, ids)
            changed += [h["id"] for h in low["results"]] != found
    assert changed >= 3, "one list probed should miss results that all 32 find"
