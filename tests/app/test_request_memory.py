"""Memory and decode work a client can make a worker spend: a failed decode keeps nothing,
a request's media are bounded in pixels and seconds as a whole, the result cache in bytes."""

from __future__ import annotations

import functools
import io
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from tests.app.conftest import running, settings_for
from tests.app.test_hostile import media_root, rss_mb, slow_png  # noqa: F401 (a fixture)
from tests.models.test_inputs import data_uri

AT_LIMIT = 4096  # the service's default max_image_pixels is 4096 x 4096


@functools.cache
def corrupt_png() -> bytes:
    """A 4096 x 4096 grey PNG whose zlib checksum is broken: its header is legal, so the
    decoder allocates the whole image before the stream fails at its end."""
    buf = io.BytesIO()
    Image.new("L", (AT_LIMIT, AT_LIMIT), 7).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    at = data.rfind(b"IDAT")
    (length,) = struct.unpack(">I", data[at - 4 : at])
    data[at + 4 + length - 1] ^= 0xFF  # the stream's last byte: its Adler-32
    return bytes(data)


def variant(png: bytes, i: int) -> str:
    """Distinct bytes (PNG readers ignore what follows the image), so no cache answers."""
    return data_uri("image/png", png + i.to_bytes(4, "big"))


def test_corrupt_images_at_the_pixel_limit_keep_no_memory(media_root: Path) -> None:  # noqa: F811
    with running(settings_for(media_root)) as client:

        def send(i: int) -> int:
            body = {"query": {"image": variant(corrupt_png(), i)}, "k": 3}
            return client.post("/v1/search", json=body).status_code

        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(send, range(8))) == {422}  # warm: thread arenas, pools
            before = rss_mb()
            assert set(pool.map(send, range(100, 150))) == {422}
        after = rss_mb()
    assert after - before < 50, (before, after)


def test_a_request_of_many_images_at_the_pixel_limit_is_refused_before_any_decode(
    media_root: Path,  # noqa: F811
) -> None:
    png = slow_png()  # legal, 4096 x 4096
    batch = {"queries": [{"query": {"image": variant(png, i)}, "k": 3} for i in range(20)]}
    embed = {"modality": "image", "inputs": [variant(png, i) for i in range(20)]}
    with running(settings_for(media_root)) as client:
        for route, body in (("/v1/search/batch", batch), ("/v1/embed", embed)):
            t0 = time.perf_counter()
            r = client.post(route, json=body)
            took = time.perf_counter() - t0
            assert r.status_code == 413, r.text
            assert "HCLIP_MAX_REQUEST_PIXELS" in r.json()["error"], r.text
            assert r.json()["error"].startswith(("queries[4].query.image", "inputs[4]")), r.text
            assert took < 1.0, f"{route}: refused after {took:.2f} s"
        # within the budget (four at the limit), the same images are answered
        r = client.post("/v1/embed", json={"modality": "image", "inputs": embed["inputs"][:4]})
        assert r.status_code == 200, r.text
        metrics = client.get("/metrics").text
    assert 'hclip_encode_batch_size_sum{modality="image"} 4.0' in metrics


def test_a_request_of_many_long_clips_is_refused_by_its_seconds(media_root: Path) -> None:  # noqa: F811
    from tests.app.test_hostile import wav

    clip = data_uri("audio/wav", wav(300, seconds=1.0))  # the encoder reads 0.1 s of each
    with running(settings_for(media_root, max_request_audio_seconds=0.5)) as client:
        ok = client.post("/v1/embed", json={"modality": "audio", "inputs": [clip] * 5})
        over = client.post("/v1/embed", json={"modality": "audio", "inputs": [clip] * 6})
    assert ok.status_code == 200, ok.text
    assert over.status_code == 413 and "HCLIP_MAX_REQUEST_AUDIO_SECONDS" in over.text, over.text
    assert over.json()["error"].startswith("inputs[5]: the request's media reach 0.6 s of audio")


def test_the_result_cache_is_bounded_in_bytes(tmp_path: Path) -> None:
    """k = 100 over 4 kB payloads: each cached result is about 420 kB; 300 distinct searches
    would keep 125 MB in a cache bounded by entries."""
    import numpy as np

    from tests.app.conftest import build_index, records_v
    from tests.conftest import make_model_dir

    rows = records_v("big", n=120)
    for r in rows:
        r["payload"]["blob"] = "x" * 4096
    build_index(tmp_path / "root", make_model_dir(tmp_path / "m"), rows, tmp_path)
    rng = np.random.default_rng(0)
    queries = [{"query": {"a": rng.standard_normal(6).tolist()}, "k": 100} for _ in range(330)]
    with running(settings_for(tmp_path / "root", cache_max_bytes=8 << 20)) as client:
        for q in queries[:30]:  # warm
            assert client.post("/v1/search", json=q).status_code == 200
        before = rss_mb()
        for q in queries[30:]:
            assert len(client.post("/v1/search", json=q).content) > 400_000
        after = rss_mb()
    assert after - before < 40, (before, after)
