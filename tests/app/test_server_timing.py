"""Server-Timing: each response says where its time went (each encode and search: its wait,
its call and that call's batch; a raw input's decode and its model's forward within the
encode call; the total), from the real batchers through uvicorn; a cached answer names
neither; a batch names its longest; HCLIP_SERVER_TIMING=false sends none."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import orjson

from app.core import timing
from app.services.batching import MicroBatcher, Timed
from tests.app.conftest import build_index, running, settings_for
from tests.app.test_hostile import GOOD, media_model

METRIC = re.compile(r'([A-Za-z0-9-]+);dur=([0-9.]+)(?:;desc="([^"]*)")?(, |$)')


def stages(header: str) -> dict[tuple[str, str], float]:
    """(metric, description) -> ms; the whole header must parse."""
    parts = list(METRIC.finditer(header))
    assert "".join(m[0] for m in parts) == header, f"not Server-Timing metrics: {header!r}"
    return {(m[1], m[3] or ""): float(m[2]) for m in parts}


def test_a_search_says_what_its_encodes_and_its_search_took(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root, cache_max_bytes=0)) as client:
        body = {"query": {"a": rows[0]["a"], "b": rows[0]["b"]}, "k": 5}
        r = client.post("/v1/search", json=body)
        assert r.status_code == 200, r.text
        got = stages(r.headers["server-timing"])
        view = r.json()["view"]
        names = {m for m, _ in got}
        assert names == {"encode-wait", "encode", "search-wait", "search", "total"}, got
        assert {d for m, d in got if m == "encode"} == {"a (batch of 1)", "b (batch of 1)"}
        assert ("search", f"{view} (batch of 1)") in got
        # the stages happen within the request: none takes longer than the total
        total = got[("total", "")]
        assert all(0 <= ms <= total for ms in got.values()) and total > 0

        # a batch's queries meet in the batchers: the longest of each stage, its batch's size
        queries = [{"query": {"a": r_["a"], "b": r_["b"]}, "k": 3} for r_ in rows[1:9]]
        r = client.post("/v1/search/batch", json={"queries": queries})
        assert r.status_code == 200, r.text
        got = stages(r.headers["server-timing"])
        sizes = [int(d.rsplit(" ", 1)[1][:-1]) for m, d in got if m == "search"]
        assert len(sizes) == 1 and 1 <= sizes[0] <= 8

        # a client's mistake is answered before any stage
        r = client.post("/v1/search", json={"query": {"z": [1.0]}})
        assert r.status_code == 422
        assert set(stages(r.headers["server-timing"])) == {("total", "")}


def test_a_raw_input_says_what_its_decode_and_its_forward_took(tmp_path) -> None:
    """Within a raw input's encode call, its decode and the model's forward, as the encode
    thread timed them: each shorter than the call, and together too (what is left is the
    call's hops between threads)."""
    rows = [{"id": f"r{i}", "image": GOOD["image"](i), "vec": [i, 1, 2]} for i in range(6)]
    build_index(tmp_path / "root", media_model(tmp_path, {"image", "vec"}), rows, tmp_path)
    with running(settings_for(tmp_path / "root", cache_max_bytes=0)) as client:
        r = client.post("/v1/search", json={"query": {"image": GOOD["image"](9)}, "k": 3})
        assert r.status_code == 200, r.text
        got = stages(r.headers["server-timing"])
        one = "image (batch of 1)"
        call = got[("encode", one)]
        decode, forward = got[("decode", one)], got[("forward", one)]
        assert 0 < decode <= call and 0 < forward <= call
        assert decode + forward <= call + 0.02  # each rounded to 0.01 ms
        assert {m for m, _ in got} == {
            "encode-wait", "encode", "decode", "forward", "search-wait", "search", "total"
        }  # fmt: skip

        # an input that fails its decode on the encode thread is a 422 that says what the
        # decode took, and has no forward
        r = client.post("/v1/search", json={"query": {"image": "data:image/png;base64,AAAA"}})
        assert r.status_code == 422 and "could not be decoded" in r.text, r.text
        got = stages(r.headers["server-timing"])
        assert ("decode", one) in got and ("forward", one) not in got, got


def test_a_cached_answer_names_no_stage(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root)) as client:
        body = orjson.dumps({"query": {"a": rows[3]["a"], "b": rows[3]["b"]}, "k": 5})
        first = client.post("/v1/search", content=body)
        again = client.post("/v1/search", content=body)
        assert first.json()["cached"] is False and again.json()["cached"] is True
        assert "search" in {m for m, _ in stages(first.headers["server-timing"])}
        assert set(stages(again.headers["server-timing"])) == {("total", "")}


def test_server_timing_can_be_turned_off(vector_index) -> None:
    root, _, rows = vector_index
    with running(settings_for(root, server_timing=False)) as client:
        r = client.post("/v1/search", json={"query": {"a": rows[0]["a"]}})
        assert r.status_code == 200 and "server-timing" not in r.headers
        assert r.headers["x-request-id"]  # the rest of the request's context is still there


def test_the_batcher_tells_each_request_its_wait_and_its_call() -> None:
    """Three requests into a batcher whose call takes 60 ms: the first is called alone, the
    two that came while it ran wait for it and go together."""

    def run(items: list[int]) -> list[int | Exception]:
        time.sleep(0.06)
        return [i * 2 for i in items]

    async def request(b: MicroBatcher, i: int, delay: float) -> tuple[int, bytes]:
        stages_, token = timing.begin()
        try:
            await asyncio.sleep(delay)
            got = await b.submit(i)
            return got, stages_.header()
        finally:
            timing.end(token)

    async def main() -> list[tuple[int, bytes]]:
        b = MicroBatcher(run, ThreadPoolExecutor(1), 8, 0.0, stage=("encode", "caption"))
        return await asyncio.gather(request(b, 1, 0.0), request(b, 2, 0.02), request(b, 3, 0.02))

    answers = asyncio.run(main())
    assert [a for a, _ in answers] == [2, 4, 6]
    first, second, third = (stages(h.decode()) for _, h in answers)
    assert first[("encode-wait", "caption")] < 20
    assert 55 <= first[("encode", "caption (batch of 1)")] < 200
    for later in (second, third):
        assert 25 <= later[("encode-wait", "caption")] < 200  # the first call's remaining 40 ms
        assert 55 <= later[("encode", "caption (batch of 2)")] < 200
        assert later[("total", "")] >= 55 + 25


def test_the_parts_a_call_timed_reach_each_request_of_its_batch() -> None:
    def run(items: list[int]) -> Timed[int]:
        time.sleep(0.03)
        return Timed([i + 1 for i in items], {"decode": 0.001 * len(items), "forward": 0.025})

    async def request(b: MicroBatcher, i: int) -> bytes:
        stages_, token = timing.begin()
        try:
            await b.submit(i)
            return stages_.header()
        finally:
            timing.end(token)

    async def main() -> list[bytes]:
        b = MicroBatcher(run, ThreadPoolExecutor(1), 8, 0.0, stage=("encode", "caption"))
        return await asyncio.gather(request(b, 1), request(b, 2), request(b, 3))

    for header in asyncio.run(main()):
        got = stages(header.decode())
        assert got[("decode", "caption (batch of 3)")] == 3.0
        assert got[("forward", "caption (batch of 3)")] == 25.0
        assert got[("encode", "caption (batch of 3)")] >= 28


def test_a_stage_met_twice_keeps_its_longest_and_descriptions_stay_in_a_header() -> None:
    s = timing.Stages()
    s.add("encode", "a", 0.010, 4)
    s.add("encode", "a", 0.030, 2)
    s.add("encode", "a", 0.020, 8)
    s.add("search", 'view "ünï"\\', 0.001)
    got = stages(s.header().decode("ascii"))
    assert got[("encode", "a (batch of 2)")] == 30.0
    assert ("search", "view ??n???") in got  # a quote, a backslash, non-ASCII: each a "?"
    timing.record("encode", "nowhere", 1.0)  # outside a request: nothing to add to, no error
