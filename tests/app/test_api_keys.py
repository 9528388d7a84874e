"""Optional API keys for reads: absent, wrong, doubled and right keys on every read route, the
key checked before the body is read, /metrics with a key of its own, health and the page open,
the client sending its key; a keys file that cannot be read stops the start."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.api.auth import KeyFileError
from app.client import Client, HclipError
from app.main import create_app
from tests.app.conftest import running, settings_for

JSON = {"content-type": "application/json"}


def reads(rows: list[dict]) -> list[tuple[str, str, dict | None]]:
    q = {"query": {"a": rows[0]["a"]}, "k": 3}
    return [
        ("POST", "/v1/search", q),
        ("POST", "/v1/search/batch", {"queries": [q]}),
        ("POST", "/v1/embed", {"modality": "a", "inputs": [rows[0]["a"]]}),
        ("GET", f"/v1/records/{rows[0]['id']}", None),
        ("GET", f"/v1/records/{rows[0]['id']}/embeddings", None),
        ("GET", f"/v1/records?id={rows[0]['id']}", None),
        ("GET", f"/v1/embeddings?id={rows[0]['id']}", None),
        ("GET", "/v1/info", None),
    ]


def test_read_routes_need_a_key_and_health_stays_open(vector_index, tmp_path: Path) -> None:
    root, _, rows = vector_index
    (tmp_path / "keys").write_text("# one key a line\nfrom-file\n")
    settings = settings_for(
        root, api_keys="alpha, beta", api_keys_file=tmp_path / "keys", metrics_key="scrape"
    )
    with running(settings) as client:
        for method, path, body in reads(rows):
            for header in (None, "Bearer", "Bearer wrong", "Basic alpha", "Bearer alph"):
                headers = {"authorization": header} if header else {}
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, header, r.text)
                assert r.json()["error_type"] == "unauthorized" and r.json()["request_id"]
            for key in ("alpha", "beta", "from-file"):
                r = client.request(
                    method, path, json=body, headers={"authorization": f"Bearer {key}"}
                )
                assert r.status_code == 200, (path, key, r.text)
        assert client.get("/metrics", headers={"authorization": "Bearer alpha"}).status_code == 401
        assert client.get("/metrics", headers={"authorization": "Bearer scrape"}).status_code == 200
        for open_path in ("/healthz", "/readyz", "/", "/openapi.json", "/static/app.js"):
            assert client.get(open_path).status_code == 200, open_path
        url = str(client.base_url)
        with Client(url, api_key="beta") as hclip:
            assert len(hclip.search({"a": rows[0]["a"]}, k=3).hits) == 3
        with Client(url) as hclip, pytest.raises(HclipError) as refused:
            hclip.search({"a": rows[0]["a"]}, k=3)
        assert refused.value.status == 401


def test_every_route_reads_the_authorization_header_the_same_way(vector_index) -> None:
    """Two Authorization headers (in either order) or a malformed one present no key, on
    every read route alike; a body too large or not JSON is never read without a key."""
    root, _, rows = vector_index
    with running(settings_for(root, api_keys="good")) as client:
        for method, path, body in reads(rows):
            doubled = [["Bearer wrong", "Bearer good"], ["Bearer good", "Bearer wrong"]]
            malformed = [["Bearer good", "Bearer good"], ["Bearer"], ["good"], ["Basic good"]]
            for pair in doubled + malformed:
                headers = [("authorization", h) for h in pair]
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, pair, r.text)
            r = client.request(method, path, json=body, headers={"authorization": "bearer good"})
            assert r.status_code == 200, (path, r.text)
        for path in ("/v1/search", "/v1/search/batch", "/v1/embed"):
            r = client.post(path, content=b"{not json", headers=JSON)
            assert r.status_code == 401, (path, r.text)  # refused before its body is parsed


def test_without_keys_reads_are_open(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root)) as client:
        for method, path, body in reads(rows):
            assert client.request(method, path, json=body).status_code == 200, path
        assert client.get("/metrics").status_code == 200


def test_an_unreadable_keys_file_stops_the_start(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, api_keys_file=tmp_path / "missing")
    with pytest.raises(KeyFileError, match=r"HCLIP_API_KEYS_FILE .*missing"):
        create_app(settings)


@pytest.mark.parametrize("keys", [" , ", ",", "  "])
def test_keys_that_name_no_key_stop_the_start(tmp_path: Path, keys: str) -> None:
    with pytest.raises(KeyFileError, match="names no key"):
        create_app(settings_for(tmp_path, api_keys=keys))


def test_a_keys_file_of_comments_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# the keys go here\n\n   \n")
    with pytest.raises(KeyFileError, match="holds no key"):
        create_app(settings_for(tmp_path, api_keys_file=tmp_path / "keys"))
    # an empty HCLIP_API_KEYS is unset, as compose passes one through: open, and it starts
    create_app(settings_for(tmp_path, api_keys=""))


def test_the_demo_media_and_examples_need_a_key_when_keys_are_on(
    vector_index, tmp_path: Path
) -> None:
    """They are records' payloads (images, clips, their labels): as guarded as /v1/records."""
    root, _, _ = vector_index
    media = tmp_path / "media"
    (media / "images").mkdir(parents=True)
    (media / "images" / "7.png").write_bytes(b"\x89PNG a record's image")
    (media / "examples.json").write_text('{"image": [{"url": "/media/images/7.png"}]}')
    (tmp_path / "secret.txt").write_text("outside the media folder")
    with running(settings_for(root, api_keys="alpha", media_dir=media)) as client:
        files = {"/media/images/7.png": "images/7.png", "/media/examples.json": "examples.json"}
        for path in (*files, "/v1/demo/examples"):
            assert client.get(path).status_code == 401, path
            r = client.get(path, headers={"authorization": "Bearer alpha"})
            assert r.status_code == 200, (path, r.text)
            if path in files:
                assert r.content == (media / files[path]).read_bytes()
        for escape in (
            "/media/../secret.txt",
            "/media/%2e%2e/secret.txt",
            "/media/images/../../secret.txt",
        ):
            r = client.get(escape, headers={"authorization": "Bearer alpha"})
            assert r.status_code == 404 and b"outside" not in r.content, (escape, r.text)
    with running(settings_for(root, media_dir=media)) as client:  # keys off: open, as before
        assert client.get("/media/images/7.png").status_code == 200
        assert client.get("/v1/demo/examples").json()["image"][0]["url"] == "/media/images/7.png"
