"""POST /v1/search on its one path (a PlainRoute: FastAPI's declaration, Starlette's call; it
had a second path in front of the framework until issue 39): every JSON content type gets the
same results, every client mistake a 4xx envelope carrying the request's id, bodies over the
limit a 413, no version a 503 with Retry-After, and every request is counted under its route;
a PlainRoute refuses an endpoint FastAPI would have to fill in."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response
from starlette.routing import Route

from app.api.http import PlainRoute
from app.main import create_app
from tests.app.conftest import running, settings_for

FAST = {"content-type": "application/json"}
ROUTED = {"content-type": "application/json;charset=utf-8"}


def post(client, body: bytes, headers: dict[str, str]):
    return client.post("/v1/search", content=body, headers=headers)


def test_a_search_gets_the_same_answer_whatever_the_json_content_type(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root)) as client:
        for probe in rows[:6]:
            body = orjson.dumps({"query": {"a": probe["a"], "b": probe["b"]}, "k": 5})
            fast = post(client, body, FAST)
            routed = post(client, body, ROUTED)
            assert fast.status_code == routed.status_code == 200, (fast.text, routed.text)
            a, b = fast.json(), routed.json()
            assert a.pop("cached") is False and b.pop("cached") is True  # one cache, both paths
            assert a == b
            for r in (fast, routed):
                assert r.headers["content-type"] == "application/json"
                assert r.headers["x-hclip-instance"] and len(r.headers["x-request-id"]) == 16
        # a client's request id comes back on the fast path too
        one = orjson.dumps({"query": {"a": rows[0]["a"]}})
        r = post(client, one, FAST | {"x-request-id": "abc-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"


BAD = {
    "not JSON": b"{not json",
    "unknown field": b'{"query": {"a": [1, 2, 3, 4, 5, 6]}, "smell": 1}',
    "k a boolean": b'{"query": {"a": [1, 2, 3, 4, 5, 6]}, "k": true}',
    "k over the limit": b'{"query": {"a": [1, 2, 3, 4, 5, 6]}, "k": 100000}',
    "unknown modality": b'{"query": {"z": [1, 2]}}',
    "wrong length": b'{"query": {"a": [1, 2]}}',
    "every modality": b'{"query": {"a": [1,2,3,4,5,6], "b": [1,2,3,4,5], "c": [1,2,3,4]}}',
    "nested too deep": b'{"query": {"a": ' + b"[" * 40 + b"]" * 40 + b"}}",
    "a list": b"[1, 2]",
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_client_mistake_gets_its_error_whatever_the_content_type(vector_index, case: str) -> None:
    root, _, _ = vector_index
    with running(settings_for(root)) as client:
        fast = post(client, BAD[case], FAST)
        routed = post(client, BAD[case], ROUTED)
        assert 400 <= fast.status_code < 500, fast.text
        assert fast.status_code == routed.status_code
        a, b = fast.json(), routed.json()
        assert a["request_id"] == fast.headers["x-request-id"]
        assert (a["error"], a["error_type"]) == (b["error"], b["error_type"])


def test_bodies_over_the_limit_are_413_announced_or_streamed(vector_index) -> None:
    root, _, _ = vector_index
    with running(settings_for(root, max_body_bytes=2048)) as client:
        big = b'{"query": {"a": [' + b"1," * 2000 + b"1]}}"
        assert post(client, big, FAST).status_code == 413

        def chunks():
            for _ in range(10):
                yield b" " * 1000

        r = client.post("/v1/search", content=chunks(), headers=FAST)
        assert r.status_code == 413 and r.json()["error_type"] == "too_large"


def test_not_ready_is_503_with_retry_after(tmp_path) -> None:
    (tmp_path / "root").mkdir()
    with running(settings_for(tmp_path / "root"), wait_ready=False) as client:
        r = post(client, b'{"query": {"a": [1, 2, 3, 4, 5, 6]}}', FAST)
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready"
        assert r.headers["retry-after"] == "1"


def test_requests_are_counted_under_the_route(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root)) as client:
        body = orjson.dumps({"query": {"a": rows[1]["a"]}, "k": 3})
        for _ in range(3):
            assert post(client, body, FAST).status_code == 200
        assert post(client, b'{"query": {"a": [1]}}', FAST).status_code == 422
        text = client.get("/metrics").text
        ok = 'hclip_requests_total{endpoint="/v1/search",method="POST",status="200"} 3.0'
        bad = 'hclip_requests_total{endpoint="/v1/search",method="POST",status="422"} 1.0'
        assert ok in text and bad in text


def test_search_routes_are_plain_routes_first_on_the_apps_own_router() -> None:
    # FastAPI matches an included router's routes twice a request and wraps each endpoint in
    # its dependency solving: the search routes skip both (app.api.http.PlainRoute), and no
    # route is matched before them, not even FastAPI's own pages (/openapi.json, /docs, /redoc).
    app = create_app(settings_for(Path("unused")))
    routes = [(type(r), getattr(r, "path", None)) for r in app.router.routes]
    paths = ["/v1/search", "/v1/search/batch", "/v1/embed"]
    assert routes[:3] == [(PlainRoute, p) for p in paths]
    assert {(Route, "/openapi.json"), (Route, "/docs"), (Route, "/redoc")} <= set(routes[3:])
    documented = app.openapi()["paths"]
    for p in paths:
        operation = documented[p]["post"]
        assert "requestBody" in operation and "200" in operation["responses"]


async def _takes_a_query(request: Request, k: int = 10) -> Response:
    return Response()


async def _key() -> str:
    return "k"


async def _plain(request: Request) -> Response:
    return Response()


def _sync(request: Request) -> Response:
    return Response()


@pytest.mark.parametrize(
    "endpoint, dependencies",
    [(_takes_a_query, None), (_sync, None), (_plain, [Depends(_key)])],
    ids=["a query parameter", "not async", "a dependency"],
)
def test_a_plain_route_refuses_what_fastapi_would_have_to_solve(endpoint, dependencies) -> None:
    # FastAPI would fill these in; a PlainRoute would call the endpoint without them, so it
    # refuses them where the route is declared rather than failing every request.
    router = APIRouter(route_class=PlainRoute)
    with pytest.raises(TypeError, match="route /x: a PlainRoute takes"):
        router.add_api_route("/x", endpoint, methods=["POST"], dependencies=dependencies)
    router.add_api_route("/y", _plain, methods=["POST"])  # the one form it takes
