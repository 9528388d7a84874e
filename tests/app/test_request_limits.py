"""Requests that used to break the service: integers beyond 64 bits, a body of 600,000 keys that
held the event loop for seconds, a body that stops arriving, and the early 413's envelope and
metrics label."""

from __future__ import annotations

import socket
import threading
import time

import orjson
import pytest

from tests.app.conftest import running, settings_for, wait_until

JSON = {"content-type": "application/json"}
HUGE = 2**64


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/search", {"k": HUGE}),
        ("/v1/search", {"effort": HUGE}),
        ("/v1/search/batch", {"k": HUGE}),
        ("/v1/search/batch", {"effort": HUGE}),
    ],
)
def test_integers_beyond_64_bits_are_422_on_every_route(vector_index, path, body) -> None:
    root, _, rows = vector_index
    query = {"query": {"a": rows[0]["a"]}, **body}
    payload = {"queries": [query]} if path.endswith("batch") else query
    with running(settings_for(root)) as client:
        for content_type in ("application/json", "application/json; charset=utf-8"):
            r = client.post(path, content=_big(payload), headers={"content-type": content_type})
            assert r.status_code == 422, r.text
            assert r.json()["error_type"] == "invalid_input" and "must be between 1 and" in r.text


def _big(payload: dict) -> bytes:
    """JSON with integers orjson cannot write (beyond 64 bits), written by the standard library."""
    import json

    return json.dumps(payload).encode()


def test_a_body_of_600000_keys_is_refused_while_a_search_is_answered(vector_index) -> None:
    root, _, rows = vector_index
    huge = (
        b'{"query": {"a": [1,2,3,4,5,6]}, "filter": {'
        + b",".join(b'"k%d": 1' % i for i in range(600_000))
        + b"}}"
    )
    assert len(huge) < 8 * 1024 * 1024  # under the body limit: the schema's bound refuses it
    with running(settings_for(root)) as client:
        search = orjson.dumps({"query": {"a": rows[2]["a"]}, "k": 3})
        assert client.post("/v1/search", content=search, headers=JSON).status_code == 200
        answers: dict[str, object] = {}

        def send_huge(path: str) -> None:
            answers[path] = client.post(path, content=huge, headers=JSON)

        for path, named in (
            ("/v1/search", "filter: Dictionary should have at most 64 items"),
            ("/v1/embed", "filter: Extra inputs are not permitted"),
        ):
            t = threading.Thread(target=send_huge, args=(path,))
            t.start()
            time.sleep(0.05)  # the huge body is on its way or being refused
            t0 = time.perf_counter()
            r = client.post("/v1/search", content=search, headers=JSON)
            took = time.perf_counter() - t0
            t.join(60)
            assert r.status_code == 200 and took < 1.0, (path, took)
            refused = answers[path]
            assert refused.status_code == 422, (path, refused.text[:300])  # type: ignore[attr-defined]
            # refused by the schema where the body is parsed: a bound on filter fields, or none
            assert named in refused.text  # type: ignore[attr-defined]


def raw_exchange(port: int, head: bytes, body: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send a request's head and part of its body, then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        t0 = time.monotonic()
        s.sendall(head + body)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
        return got, time.monotonic() - t0


@pytest.mark.parametrize("path", ["/v1/search", "/v1/search/batch", "/v1/embed"])
def test_a_body_that_stops_arriving_is_dropped_after_the_deadline(vector_index, path) -> None:
    root, _, _ = vector_index
    with running(settings_for(root, body_timeout_s=1.0)) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1])
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000000\r\n\r\n"
        ).encode()
        got, took = raw_exchange(port, head, b'{"query": ', wait_s=10)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"HCLIP_BODY_TIMEOUT_S" in got and b'"request_id"' in got
        assert 0.9 < took < 5, took  # dropped at the deadline, and the connection closed
        assert client.get("/healthz").status_code == 200


def test_the_early_413_has_a_request_id_and_its_route(vector_index) -> None:
    root, _, _ = vector_index
    with running(settings_for(root, max_body_bytes=2048)) as client:
        big = b'{"queries": [' + b"1," * 2000 + b"1]}"
        r = client.post("/v1/search/batch", content=big, headers=JSON | {"x-request-id": "big-1"})
        assert r.status_code == 413
        assert r.json()["request_id"] == "big-1" and r.headers["x-request-id"] == "big-1"
        r = client.post("/v1/search", content=big + b" " * 10, headers=JSON)
        assert r.status_code == 413 and r.json()["request_id"] == r.headers["x-request-id"]
        assert client.get("/static/style.css").status_code == 200
        # counted once the response is out: the client may ask for the metrics before that
        wait_until(lambda: 'endpoint="/static"' in client.get("/metrics").text)
        text = client.get("/metrics").text
        assert 'endpoint="/v1/search/batch",method="POST",status="413"} 1.0' in text
        assert 'endpoint="/v1/search",method="POST",status="413"} 1.0' in text
        assert 'endpoint="/static",method="GET",status="200"}' in text
        assert 'endpoint="unmatched"' not in text
