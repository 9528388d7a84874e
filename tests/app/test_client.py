"""The Python client against a real server: every method, media from Python values, retries on
503 honouring Retry-After, a timeout, and the asynchronous client."""

from __future__ import annotations

import asyncio
import io
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.client import AsyncClient, Client, HclipError, HclipTimeout, SearchResult, server_timing
from indexer.store import artifact
from tests.app.conftest import build_index, records_v, running, settings_for
from tests.app.test_hostile import GOOD, media_model, slow_image
from tests.models.test_inputs import wav_bytes


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("client")
    rows = [
        {
            "id": f"g{i}",
            "image": GOOD["image"](i),
            "audio": GOOD["audio"](i),
            "vec": [i, 1, 2],
            "payload": {"n": i, "tag": "even" if i % 2 == 0 else "odd"},
        }
        for i in range(24)
    ]
    root = tmp / "root"
    build_index(root, media_model(tmp, {"image", "audio", "vec"}), rows, tmp,
                "--filter-fields", "tag")  # fmt: skip
    return root, tmp


def test_every_method(media) -> None:
    root, tmp = media
    png = tmp / "q.png"
    Image.fromarray((np.arange(256).reshape(16, 16) % 251).astype(np.uint8)).save(png)
    with running(settings_for(root)) as http, Client(str(http.base_url)) as c:
        assert c.health() is True
        version = c.ready()
        assert version == artifact.read_current(root)
        info = c.info()
        assert info.modalities == {"audio": "audio", "image": "image", "vec": "vector"}
        assert info.d == 4 and info.omega is not None and info.omega.shape == (4,)
        # one image, five ways: a path (str and Path), bytes, a PIL image, an array
        as_path = c.search({"image": str(png)}, k=3)
        assert isinstance(as_path, SearchResult) and len(as_path.hits) == 3
        # where its time went, as the server timed it (a cache miss: every stage)
        stages = as_path.timing
        assert set(stages) == {"encode-wait image", "encode image", "decode image",
                               "forward image", "search-wait image", "search image",
                               "total"}, stages  # fmt: skip
        assert 0 < stages["encode image"] <= stages["total"]
        assert 0 < stages["forward image"] <= stages["encode image"]
        for same in (png, png.read_bytes(), Image.open(png), np.asarray(Image.open(png))):
            assert [h.id for h in c.search({"image": same}, k=3).hits] == [
                h.id for h in as_path.hits
            ]
        # audio as WAV bytes, and as (samples, rate)
        t = np.arange(1600) / 16000
        tone = 0.5 * np.sin(2 * np.pi * 440 * t)
        by_samples = c.search({"audio": (tone, 16000)}, k=2)
        assert len(by_samples.hits) == 2 and by_samples.view == "audio"
        assert len(c.search({"audio": wav_bytes(seconds=0.1, channels=1)}, k=2).hits) == 2
        # vectors, embeddings, filters, effort (ignored by flat views)
        r = c.search({"vec": np.array([3.0, 1.0, 2.0])}, filter={"tag": "odd"}, k=5, effort=64)
        assert all(h.payload["tag"] == "odd" for h in r.hits) and r.effort is None
        emb = c.embed("vec", [[3, 1, 2], np.array([4.0, 1, 2])])
        assert emb.shape == (2, 4) and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
        again = c.search(embeddings={"vec": emb[0]}, filter={"tag": "odd"}, k=5)
        assert [h.id for h in again.hits] == [h.id for h in r.hits]
        rec = c.record("g7")
        assert rec.id == "g7" and rec.payload == {"n": 7, "tag": "odd"}
        assert rec.modalities == ["audio", "image", "vec"] and rec.index_version == version
        embs = c.record_embeddings("g7")
        assert set(embs.embeddings) == {"audio", "image", "vec"}
        assert embs.model_fingerprint == info.raw["model"]["fingerprint"]
        batch = c.search_batch([{"query": {"vec": [1, 1, 2]}, "k": 2},
                                {"query": {"image": b"not an image"}}])  # fmt: skip
        assert isinstance(batch[0], SearchResult) and len(batch[0].hits) == 2
        assert isinstance(batch[1], HclipError) and batch[1].status == 422
        with pytest.raises(HclipError) as err:
            c.record("nope")
        assert err.value.status == 404 and err.value.error_type == "not_found"
        assert err.value.request_id and len(err.value.request_id) == 16
        with pytest.raises(HclipError) as err:
            c.search({"vec": [1, 2]})
        assert err.value.status == 422 and "query.vec" in err.value.message


def test_503_is_retried_as_retry_after_says(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    with running(settings_for(root), wait_ready=False) as http:
        publish = threading.Timer(
            0.3, lambda: build_index(root, model_dir, records_v("v1", n=40), tmp_path)
        )
        publish.start()
        t0 = time.monotonic()
        with Client(str(http.base_url), retries=5) as c:
            r = c.search(embeddings={"a": [0.1] * 8}, k=2)  # 503 not_ready until published
        took = time.monotonic() - t0
        publish.join()
        assert len(r.hits) == 2
        assert took >= 1.0  # waited Retry-After (1 s) at least once
    # With no retries left, the 503 itself, with its type.
    with running(settings_for(tmp_path / "empty"), wait_ready=False) as empty:
        with Client(str(empty.base_url), retries=0) as c, pytest.raises(HclipError) as err:
            c.search(embeddings={"a": [0.1] * 8})
        assert err.value.status == 503 and err.value.error_type == "not_ready"


def test_a_timeout(media) -> None:
    root, _ = media
    settings = settings_for(root, max_media_bytes=8 << 20, max_request_pixels=16 * 4096 * 4096)
    with running(settings) as http, Client(str(http.base_url), timeout=0.05) as c:
        c.info()  # the client's one-off lookup, outside the timed call
        # 16 images at the pixel limit take the server ten times the client's 50 ms on any
        # CPU (one alone took under 50 ms on a fast one)
        with pytest.raises(HclipTimeout):
            c.search_batch([{"query": {"image": slow_image(i)}} for i in range(16)])


def test_the_async_client(media) -> None:
    root, _ = media

    async def main(url: str) -> None:
        async with AsyncClient(url) as c:
            assert await c.health()
            info = await c.info()
            assert info.d == 4
            results = await asyncio.gather(*(c.search({"vec": [i, 1, 2]}, k=2) for i in range(8)))
            assert all(len(r.hits) == 2 for r in results)
            assert all(r.timing["search vec"] <= r.timing["total"] for r in results)
            assert (await c.embed("vec", [[1, 1, 2]])).shape == (1, 4)
            assert (await c.record("g3")).payload["n"] == 3
            assert set((await c.record_embeddings("g3")).embeddings) == {"audio", "image", "vec"}
            out = await c.search_batch([{"query": {"vec": [1, 1, 2]}}])
            assert isinstance(out[0], SearchResult)
            with pytest.raises(HclipError):
                await c.record("nope")

    with running(settings_for(root)) as http:
        asyncio.run(main(str(http.base_url)))


def test_server_timing_is_read_as_ms_per_stage() -> None:
    header = (
        'encode-wait;dur=0.04;desc="text", encode;dur=12.98;desc="text (batch of 4)", '
        'search;dur=0.37;desc="image+text (batch of 2)", total;dur=14.29'
    )
    assert server_timing(header) == {
        "encode-wait text": 0.04, "encode text": 12.98, "search image+text": 0.37, "total": 14.29
    }  # fmt: skip
    assert server_timing(None) == {} and server_timing("") == {}


def test_wav_from_samples_round_trips() -> None:
    from app.client import to_raw

    uri = to_raw((np.zeros(800), 8000), "audio")
    import base64

    assert isinstance(uri, str)
    raw = base64.b64decode(uri.split(",", 1)[1])
    with wave.open(io.BytesIO(raw)) as w:
        assert (w.getframerate(), w.getnframes(), w.getnchannels()) == (8000, 800, 1)
    with pytest.raises(TypeError, match="a text modality takes a str"):
        to_raw(3, "text")
