"""A client that leaves before its answer: its queries are dropped where they wait, before the
encoder or view call that would have taken them, and the request is counted as a 499 (under
real uvicorn, with raw sockets). A client that stays is answered as before."""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from tests.app.conftest import running, settings_for, wait_until

BATCH_WAIT_MS = 1500.0  # every batcher waits this long before its call: time to leave


def calls_made(client) -> float:
    """Encoder and view calls so far (the batch-size histograms' counts)."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("hclip_search_batch_size_count", "hclip_encode_batch_size_count")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def left_requests(client, path: str) -> float:
    labels = (f'endpoint="{path}"', 'status="499"')
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("hclip_requests_total{") and all(x in line for x in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def payload(path: str, rows: list[dict]) -> dict:
    query = {"query": {"a": rows[0]["a"]}, "k": 3}
    if path == "/v1/search/batch":
        return {"queries": [query, {"query": {"a": rows[1]["a"]}, "k": 3}]}
    if path == "/v1/embed":
        return {"modality": "a", "inputs": [rows[0]["a"]]}
    return query


@pytest.mark.parametrize("path", ["/v1/search", "/v1/search/batch", "/v1/embed"])
def test_a_query_whose_client_left_is_dropped_before_its_call(vector_index, path) -> None:
    root, _, rows = vector_index
    with running(settings_for(root, batch_wait_ms=BATCH_WAIT_MS)) as client:
        port = int(str(client.base_url).rsplit(":", 1)[1])
        before = calls_made(client)
        body = orjson.dumps(payload(path, rows))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(head + body)
            time.sleep(0.3)  # the query is queued, its batcher still waiting
        wait_until(lambda: left_requests(client, path) == 1, timeout=10)
        time.sleep(BATCH_WAIT_MS / 1000 + 0.5)  # past the wait: a call would have been made
        assert calls_made(client) == before

        # a client that stays gets its answer, after the same wait
        answered = client.post(path, content=body, headers={"content-type": "application/json"})
        assert answered.status_code == 200, answered.text
        assert calls_made(client) > before
        assert left_requests(client, path) == 1
