"""A hostile client: bad uploads fail alone, limits are enforced before the work, overload and
slow encodes answer 503 within the deadline, and a bug is a clean 500 with a request id."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from app.main import create_app
from tests.app.conftest import build_index, running, settings_for, wait_until
from tests.models.test_inputs import data_uri

MODS = {
    "image": {"kind": "image", "image_size": 8, "hidden": 8},
    "audio": {"kind": "audio", "max_seconds": 0.1, "hidden": 8},
    "text": {"kind": "text", "hidden": 8},
    "vec": {"kind": "vector", "dim": 3, "hidden": 8},
}


def png(seed: int, size: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wav(freq: float, rate: int = 16000, seconds: float = 0.1, width: int = 2, ch: int = 1) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(ch)
        w.setsampwidth(width)
        w.setframerate(rate)
        raw = np.repeat(x, ch).tobytes() if width == 2 else bytes(width * ch * len(x))
        w.writeframes(raw)
    return buf.getvalue()


def bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (20_000, 20_000), 7).save(buf, "PNG")  # 400 MB of pixels in ~400 kB
    return buf.getvalue()


MALFORMED = {
    "image": {
        "decompression bomb": lambda: bomb(),
        "not an image": lambda: b"\x89PNG\r\n\x1a\n" + b"junk" * 50,
        "truncated png": lambda: png(99)[:60],
    },
    "audio": {
        "odd byte count": lambda: wav(300)[:-1],
        "24-bit cut mid-sample": lambda: wav(300, width=3)[:-1],
        "stereo cut mid-frame": lambda: wav(300, ch=2)[:-2],
        "1 Hz header": lambda: wav(300)[:24] + (1).to_bytes(4, "little") + wav(300)[28:],
        "not a wav": lambda: b"RIFF\x00\x00\x00\x00WAVEjunk",
    },
}
GOOD = {
    "image": lambda i: data_uri("image/png", png(i)),
    "audio": lambda i: data_uri("audio/wav", wav(200 + 37 * i)),
}
MIME = {"image": "image/png", "audio": "audio/wav"}


def media_model(tmp: Path, names: set[str] | None = None) -> Path:
    """An untrained model with (some of) MODS' modalities."""
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    mods = {n: m for n, m in MODS.items() if names is None or n in names}
    cfg = ModelConfig.from_dict({"modalities": mods, "latent_dim": 4})
    return save_model(MultimodalModel(cfg), tmp / "m")


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hostile")
    model = media_model(tmp)
    words = ["zero", "one", "two", "three", "four", "five"]
    rows = [
        {
            "id": f"g{i}",
            "image": GOOD["image"](i),
            "audio": GOOD["audio"](i),
            "text": f"{words[i % 6]} and {words[i // 6 % 6]}",
            "vec": [i, 1, 2],
        }
        for i in range(30)
    ]
    build_index(tmp / "root", model, rows, tmp)
    return tmp / "root"


@pytest.mark.parametrize(("modality", "kind"), [(m, k) for m in MALFORMED for k in MALFORMED[m]])
def test_a_bad_upload_fails_only_itself(media_root: Path, modality: str, kind: str) -> None:
    bodies = [{"query": {modality: GOOD[modality](100 + i)}, "k": 5} for i in range(20)]
    bad = {"query": {modality: data_uri(MIME[modality], MALFORMED[modality][kind]())}, "k": 5}
    with running(settings_for(media_root)) as client:
        alone = [client.post("/v1/search", json=b).json()["results"] for b in bodies]
    with running(settings_for(media_root)) as client:  # a fresh cache: nothing is reused
        with ThreadPoolExecutor(21) as pool:
            futures = [pool.submit(client.post, "/v1/search", json=b) for b in [bad, *bodies]]
            responses = [f.result() for f in futures]
        # refused as the client's mistake (a truncated WAV included), never answered or a 5xx
        assert responses[0].status_code in (413, 422), responses[0].text
        for r, want in zip(responses[1:], alone, strict=True):
            assert r.status_code == 200, r.text
            got = r.json()["results"]
            # batched kernels round differently from single ones: ids equal, scores within 1e-5
            assert [h["id"] for h in got] == [h["id"] for h in want]
            assert np.allclose([h["score"] for h in got], [h["score"] for h in want], rtol=1e-5)
        metrics = client.get("/metrics").text
    # the requests really went through the encoder together
    batched = [
        line for line in metrics.splitlines()
        if line.startswith(f'hclip_encode_batch_size_bucket{{le="1.0",modality="{modality}"}}')
    ]  # fmt: skip
    count = [
        line for line in metrics.splitlines()
        if line.startswith(f'hclip_encode_batch_size_count{{modality="{modality}"}}')
    ]  # fmt: skip
    assert float(batched[0].split()[-1]) < float(count[0].split()[-1])  # some batch held > 1


def long_wav_header(seconds: int) -> bytes:
    raw = wav(300)
    frames = 16000 * seconds
    return raw[:40] + (2 * frames).to_bytes(4, "little") + raw[44:]


LIMITED = {
    "image pixels": ({"query": {"image": data_uri("image/png", bomb())}}, 413, "max_image_pixels"),
    "media bytes": (
        {"query": {"image": data_uri("image/png", bytes(600 * 1024))}},
        413,
        "max_media_bytes",
    ),
    "body bytes": (
        {"query": {"image": data_uri("image/png", bytes(7 * 1024 * 1024))}},
        413,
        "HCLIP_MAX_BODY_BYTES",
    ),
    "audio duration": (
        {"query": {"audio": data_uri("audio/wav", long_wav_header(3600))}},
        413,
        "max_audio_seconds",
    ),
    "sample rate": (
        {"query": {"audio": data_uri("audio/wav", MALFORMED["audio"]["1 Hz header"]())}},
        413,
        "min_sample_rate",
    ),
    "text length": ({"query": {"text": "seven " * 2000}}, 422, "max_text_chars"),
    "json depth": ("[" * 100_000 + "]" * 100_000, 422, "recursion limit exceeded"),
    "number magnitude": ('{"query": {"vec": [1e400, 0, 0]}}', 422, "query.vec"),
    "lone surrogate": ('{"query": {"text": "seven \\ud800"}}', 422, "not valid JSON"),
}


@pytest.mark.parametrize("limit", list(LIMITED))
def test_a_request_over_a_limit_is_refused_before_the_work(media_root: Path, limit: str) -> None:
    body, status, named = LIMITED[limit]
    with running(settings_for(media_root, max_media_bytes=512 * 1024)) as client:
        client.post("/v1/search", json={"query": {"vec": [1, 2, 3]}})  # warm
        t0 = time.perf_counter()
        if isinstance(body, str):
            r = client.post(
                "/v1/search", content=body, headers={"content-type": "application/json"}
            )
        else:
            r = client.post("/v1/search", json=body)
        took = time.perf_counter() - t0
    assert r.status_code == status, r.text
    assert named in r.json()["error"]
    assert took < 0.5, f"{limit}: refused after {took:.2f} s"


def slow_png() -> bytes:
    """A legal image, 25 kB, at the pixel limit: about 65 ms to decode and resize here."""
    buf = io.BytesIO()
    Image.new("L", (4096, 4096), 7).save(buf, "PNG")
    return buf.getvalue()


def slow_image(variant: int = 0) -> str:
    """Distinct bytes (PNG readers ignore what follows the image), so no cache answers."""
    return data_uri("image/png", slow_png() + variant.to_bytes(4, "big"))


def test_slow_encodes_answer_503_at_the_deadline_and_hold_no_other_modality(
    media_root: Path,
) -> None:
    deadline_s = 0.25
    settings = settings_for(
        media_root, request_timeout_s=deadline_s, max_media_bytes=8 * 1024 * 1024, max_pending=1000
    )
    slow = slow_image()  # 40 of them keep the image encoder busy for seconds (cache or not)
    with running(settings) as client, ThreadPoolExecutor(40) as pool:
        for i in range(3):  # warm: the first calls of each encoder pay one-off costs
            client.post("/v1/search", json={"query": {"audio": GOOD["audio"](50 + i)}})
            client.post("/v1/search", json={"query": {"vec": [50 + i, 1, 2]}})
        images = [
            pool.submit(client.post, "/v1/search", json={"query": {"image": slow}, "k": 3})
            for _ in range(40)
        ]
        time.sleep(0.1)
        others = []
        for i in range(10):
            t0 = time.perf_counter()
            r = client.post("/v1/search", json={"query": {"audio": GOOD["audio"](i)}})
            others.append((r.status_code, time.perf_counter() - t0))
            t0 = time.perf_counter()
            r = client.post("/v1/search", json={"query": {"vec": [i, 1, 2]}})
            others.append((r.status_code, time.perf_counter() - t0))
        t0 = time.perf_counter()
        statuses = [f.result().status_code for f in images]
        retry = [f.result().headers.get("retry-after") for f in images]
        image_wall = time.perf_counter() - t0
    assert all(s == 200 for s, _ in others), others
    assert max(t for _, t in others) < deadline_s, others  # the image backlog held none
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses
    assert all(r is not None for s, r in zip(statuses, retry, strict=True) if s == 503)
    assert image_wall < 5.0  # nothing waited for the whole backlog to drain


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_overload_answers_503_with_retry_after_and_memory_stays_flat(media_root: Path) -> None:
    settings = settings_for(
        media_root, max_pending=4, request_timeout_s=2.0, max_media_bytes=8 * 1024 * 1024
    )
    png = slow_png()
    with running(settings) as client, contextlib.ExitStack() as stack:
        # A client per flooding thread: httpcore's pool shared by 48 threads once closed a
        # socket another thread was reading (ReadError: Bad file descriptor, in CI).
        clients: queue.SimpleQueue[httpx.Client] = queue.SimpleQueue()
        for _ in range(48):
            clients.put(stack.enter_context(httpx.Client(base_url=client.base_url, timeout=20)))

        def post(body: dict) -> httpx.Response:
            own = clients.get()
            try:
                return own.post("/v1/search", json=body)
            finally:
                clients.put(own)

        def flood(first: int) -> list[httpx.Response]:
            bodies = [
                {"query": {"image": data_uri("image/png", png + i.to_bytes(4, "big"))}, "k": 3}
                for i in range(first, first + 96)
            ]
            with ThreadPoolExecutor(48) as pool:
                return list(pool.map(post, bodies))

        flood(0)  # warm: allocator pools, thread stacks
        before = rss_mb()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1) as probe:
            health = probe.submit(
                lambda: [client.get("/healthz").elapsed.total_seconds() for _ in range(20)]
            )
            responses = flood(1000)
            health_s = health.result()
        wall = time.perf_counter() - t0
        after = rss_mb()
        text = client.get("/metrics").text
    statuses = [r.status_code for r in responses]
    overloaded = [r for r in responses if r.json().get("error_type") == "overloaded"]
    assert overloaded and set(statuses) <= {200, 503}, statuses
    assert all(r.headers.get("retry-after") == "1" for r in overloaded)
    assert wall < 15.0
    # The probe shares this process's GIL with 48 client threads, so single probes can stall
    # on a busy machine; what must not happen is a probe waiting for the image backlog (seconds).
    assert sorted(health_s)[len(health_s) // 2] < 0.1 and max(health_s) < 1.5, health_s
    assert after - before < 60, (before, after)
    assert 'hclip_overloaded_total{reason="deadline"}' in text or overloaded


def test_a_bug_is_a_clean_500_with_the_request_id(media_root: Path, caplog) -> None:
    app = create_app(settings_for(media_root))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with running(settings_for(media_root), app=app) as client:
        with caplog.at_level(logging.ERROR, logger="app.api.middleware"):
            r = client.get("/boom", headers={"X-Request-ID": "req-42"})
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert r.json() == {
            "error": "internal error",
            "error_type": "internal_error",
            "request_id": "req-42",
        }
        assert r.headers["x-request-id"] == "req-42"
        assert any("req-42" in rec.getMessage() for rec in caplog.records)
        ok = client.get("/healthz")  # the client's next request works
        assert ok.status_code == 200 and len(ok.headers["x-request-id"]) == 16


def test_admin_tokens(media_root: Path) -> None:
    with running(settings_for(media_root, admin_token="s3cret")) as client:
        for header in ("s3cret", "Basic s3cret", "Bearer", "Bearer s3cre", "Bearer s3cret x"):
            r = client.post("/v1/admin/reload", headers={"Authorization": header})
            assert r.status_code == 401, header
        r = client.post("/v1/admin/reload", headers={"Authorization": "Bearer é".encode()})
        assert r.status_code == 401
        assert client.post(
            "/v1/admin/reload", headers={"Authorization": "Bearer s3cret"}
        ).is_success


def test_a_rejected_version_is_loaded_once_its_model_appears(tmp_path: Path, vector_index) -> None:
    import shutil

    from tests.app.conftest import records_v
    from tests.conftest import make_model_dir

    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    v1 = build_index(root, model_dir, records_v("v1", n=40), tmp_path)
    other = make_model_dir(tmp_path / "other-model", seed=3)
    v2 = build_index(tmp_path / "elsewhere", other, records_v("v2", n=40), tmp_path)
    os.rename(other, tmp_path / "parked")  # the model volume is not mounted yet
    settings = settings_for(root, reload_retry_s=0.1, reload_retry_max_s=0.4)
    with running(settings) as client:
        shutil.copytree(tmp_path / "elsewhere" / "versions" / v2, root / "versions" / v2)
        from indexer.store import artifact

        artifact.write_current(root, v2)
        wait_until(lambda: client.get("/v1/info").json()["rejected_versions"] != [])
        info = client.get("/v1/info").json()
        assert info["index_version"] == v1
        assert info["rejected_versions"][0]["version"] == v2
        assert "hclip_rejected_versions 1.0" in client.get("/metrics").text
        wait_until(lambda: client.get("/v1/info").json()["rejected_versions"][0]["attempts"] >= 2)
        os.rename(tmp_path / "parked", other)  # it appears: no new publish needed
        wait_until(lambda: client.get("/readyz").json()["index_version"] == v2, timeout=10)
        assert client.get("/v1/info").json()["rejected_versions"] == []
