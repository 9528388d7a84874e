"""Bad input gets 4xx with the error envelope, never 5xx; health, readiness, admin, refusal."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

from indexer.store import artifact
from tests.app.conftest import build_index, records_v, running, settings_for, wait_until
from tests.indexer.test_bad_records import good

D = 8


@pytest.fixture(scope="module")
def client(vector_index):
    root, _, _ = vector_index
    with running(settings_for(root, max_k=50, max_body_bytes=4096, admin_token="s3cret")) as c:
        yield c


A = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]


@pytest.mark.parametrize(
    ("body", "status", "error_type", "message"),
    [
        ({"query": {"smell": "x"}}, 422, "invalid_input", "query.smell: unknown modality"),
        ({"query": {}}, 422, "invalid_input", "names no modality"),
        (
            {"query": {"a": A, "b": A[:5], "c": A[:4]}},
            400,
            "unanswerable_query",
            "every modality",
        ),
        (
            {"embeddings": {"a": [0.1] * 7}},
            422,
            "invalid_input",
            "embeddings.a: expected 8 numbers",
        ),
        ({"embeddings": {"a": ["x"] * 8}}, 422, "validation_error", "embeddings.a[0]: Input"),
        ({"embeddings": {"a": [True] * 8}}, 422, "validation_error", "embeddings.a[0]: Input"),
        ({"query": {"a": A}, "embeddings": {"a": [0.0] * 8}}, 422, "invalid_input", "both raw"),
        ({"query": {"a": A[:3]}}, 422, "invalid_input", "query.a: vector must have length 6"),
        ({"query": {"a": [True, *A[1:]]}}, 422, "validation_error", "query.a"),
        # one style for every number out of its range: the field, the range, the setting
        ({"query": {"a": A}, "k": 0}, 422, "invalid_input", "k: must be between 1 and 50 (HCLIP_"),
        ({"query": {"a": A}, "k": 51}, 422, "invalid_input", "k: must be between 1 and 50 (HCLIP_"),
        ({"query": {"a": A}, "k": 10**6}, 422, "invalid_input", "k: must be between 1 and 50"),
        ({"query": {"a": A}, "k": 2**64}, 422, "invalid_input", "k: must be between 1 and 50"),
        ({"query": {"a": A}, "effort": 0}, 422, "invalid_input", "effort: must be between 1 and"),
        ({"query": {"a": A}, "effort": 2**64}, 422, "invalid_input", "effort: must be between"),
        (
            {"query": {"a": A}, "k": True},
            422,
            "validation_error",
            "k: Value error, expected an integer, got a boolean",
        ),
        ({"query": {"a": A}, "k": "many"}, 422, "validation_error", "k"),
        ({"query": [1, 2]}, 422, "validation_error", "query"),
        ({"query": {"a": A}, "extra": 1}, 422, "validation_error", "extra: Extra inputs"),
    ],
)
def test_bad_search_requests(client, body, status: int, error_type: str, message: str) -> None:
    r = client.post("/v1/search", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == error_type
    assert message in r.json()["error"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "9" * 401])
def test_nan_infinity_and_huge_numbers_are_not_json(client, literal: str) -> None:
    for body, field in (
        ('{"embeddings": {"a": [' + literal + ", 0, 0, 0, 0, 0, 0, 0]}}", "embeddings.a[0]"),
        ('{"query": {"a": [' + literal + ", 0, 0, 0, 0, 0]}}", "query.a"),
    ):
        r = client.post("/v1/search", content=body, headers={"content-type": "application/json"})
        # refused where the body is parsed: not JSON, or a number that is not finite
        error = r.json()["error"]
        assert r.status_code == 422 and r.json()["error_type"] == "validation_error", r.text
        assert "body: not valid JSON" in error or error.startswith(f"{field}:"), r.text


def test_numbers_beyond_float32(client) -> None:
    r = client.post("/v1/search", json={"embeddings": {"a": [1e39] + [0.0] * 7}})
    assert r.status_code == 422 and "out-of-float32-range" in r.json()["error"]
    r = client.post("/v1/search", json={"query": {"a": [2**64, 0, 0, 0, 0, 0]}})
    assert r.status_code == 422 and "beyond +-1e+06 (max_abs_value)" in r.json()["error"]
    r = client.post("/v1/search", json={"embeddings": {"a": [2e6] + [0.0] * 7}})
    assert r.status_code == 422 and "HCLIP_MAX_ABS_VALUE" in r.json()["error"]


def test_malformed_and_oversized_bodies(client) -> None:
    r = client.post("/v1/search", content="{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation_error"
    r = client.post("/v1/search", json={"query": {"a": A}, "pad": "x" * 5000})
    assert r.status_code == 413 and r.json()["error_type"] == "too_large"

    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = client.post("/v1/search", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_records_and_embeddings(client) -> None:
    r = client.get("/v1/records/v1-3").json()
    assert r["id"] == "v1-3" and r["modalities"] == ["a", "b", "c"] and r["payload"]["symbol"] >= 0
    e = client.get("/v1/records/v1-10/embeddings").json()
    assert sorted(e["embeddings"]) == ["a", "b"]  # v1-10 has no c
    assert len(e["embeddings"]["a"]) == D
    info = client.get("/v1/info").json()
    assert e["model_fingerprint"] == info["model"]["fingerprint"]
    assert len(info["model"]["omega"]) == D and info["model"]["head"] == "hclip"
    assert info["views"]["a"]["target"] == ["b", "c"] and info["counts"]["records"] == 300
    missing = client.get("/v1/records/nope")
    assert missing.status_code == 404 and missing.json()["error_type"] == "not_found"
    assert client.get("/no/such/route").json()["error_type"] == "not_found"


def test_embed_errors(client) -> None:
    r = client.post("/v1/embed", json={"modality": "smell", "inputs": ["x"]})
    assert r.status_code == 422 and "unknown modality" in r.json()["error"]
    r = client.post("/v1/embed", json={"modality": "a", "inputs": [A, A[:2]]})
    assert r.status_code == 422 and r.json()["error"].startswith("inputs[1]: vector must have")
    r = client.post("/v1/embed", json={"modality": "a", "inputs": []})
    assert r.status_code == 422 and r.json()["error_type"] == "validation_error"


def test_admin_reload_needs_the_token(client) -> None:
    assert client.post("/v1/admin/reload").status_code == 401
    bad = client.post("/v1/admin/reload", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error_type"] == "unauthorized"
    ok = client.post("/v1/admin/reload", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["changed"] is False


def test_metrics_and_health(client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    client.post("/v1/search", json={"query": {"a": A}})
    text = client.get("/metrics").text
    assert 'hclip_requests_total{endpoint="/v1/search",method="POST",status="200"}' in text
    assert "hclip_request_seconds_bucket" in text and "hclip_search_batch_size_count" in text


def test_not_ready_until_a_version_is_published(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    with running(settings_for(root), wait_ready=False) as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready"
        assert client.post("/v1/search", json={"query": {"a": A}}).status_code == 503
        build_index(root, model_dir, records_v("v1", n=40), tmp_path)
        wait_until(lambda: client.get("/readyz").status_code == 200)


def test_a_version_failing_verification_is_refused(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root, other = tmp_path / "root", tmp_path / "other"
    v1 = build_index(root, model_dir, records_v("v1", n=40), tmp_path)
    v2 = build_index(other, model_dir, records_v("v2", n=40), tmp_path)
    with running(settings_for(root, admin_token="t")) as client:
        shutil.copytree(artifact.version_dir(other, v2), artifact.version_dir(root, v2))
        broken = artifact.version_dir(root, v2) / "views" / "a.npy"
        broken.write_bytes(broken.read_bytes()[:-4] + b"\0\0\0\0")
        artifact.write_current(root, v2)
        r = client.post("/v1/admin/reload", headers={"Authorization": "Bearer t"})
        assert r.status_code == 409 and "failed verification" in r.json()["error"]
        assert client.get("/readyz").json()["index_version"] == v1
        ok = client.post("/v1/search", json={"query": {"a": A}})
        assert ok.status_code == 200 and ok.json()["index_version"] == v1
        assert 'hclip_reloads_total{outcome="rejected"}' in client.get("/metrics").text


@pytest.fixture(scope="module")
def media_client(tmp_path_factory):
    """A model with image and audio encoders, for undecodable media."""
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel
    from tests.indexer.test_bad_records import MODS

    tmp = tmp_path_factory.mktemp("media")
    model = save_model(
        MultimodalModel(ModelConfig.from_dict({"modalities": MODS, "latent_dim": 4})), tmp / "mm"
    )
    build_index(tmp / "root", model, [good(i) for i in range(5)], tmp)
    with running(settings_for(tmp / "root")) as c:
        yield c


def test_undecodable_media(media_client) -> None:
    junk = "data:image/png;base64," + base64.b64encode(b"junk").decode()
    r = media_client.post("/v1/search", json={"query": {"image": junk}})
    assert r.status_code == 422 and "query.image: image could not be decoded" in r.json()["error"]
    junk = "data:audio/wav;base64," + base64.b64encode(b"RIFFjunk").decode()
    r = media_client.post("/v1/search", json={"query": {"audio": junk}})
    assert r.status_code == 422 and "query.audio: audio could not be decoded" in r.json()["error"]
    r = media_client.post("/v1/search", json={"query": {"image": "/etc/passwd"}})
    assert r.status_code == 422 and "must be a base64 data: URI" in r.json()["error"]
    r = media_client.post("/v1/search", json={"query": {"image": good(0)["image"]}})
    assert r.status_code == 200 and len(r.json()["results"]) == 5


def test_a_version_whose_model_is_gone_is_refused(tmp_path: Path, vector_index) -> None:
    from tests.conftest import make_model_dir

    _, model_dir, _ = vector_index
    root, staging = tmp_path / "root", tmp_path / "elsewhere"
    v1 = build_index(root, model_dir, records_v("v1", n=40), tmp_path)
    other = make_model_dir(tmp_path / "other-model", seed=3)
    v2 = build_index(staging, other, records_v("v2", n=40), tmp_path)
    shutil.rmtree(other)  # gone before the service can see v2
    with running(settings_for(root, admin_token="t")) as client:
        shutil.copytree(artifact.version_dir(staging, v2), artifact.version_dir(root, v2))
        artifact.write_current(root, v2)
        r = client.post("/v1/admin/reload", headers={"Authorization": "Bearer t"})
        assert r.status_code == 409 and f"model of version {v2}" in r.json()["error"]
        assert client.get("/readyz").json()["index_version"] == v1
