"""The Redis cache is not trusted: whatever else can write to it (garbage, an empty value, a
forged answer, a query embedding of random floats or NaNs, an entry made under another secret)
gets a miss, counted in a metric, and the answer is the one the index gives."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis

from tests.app.conftest import running, settings_for
from tests.app.test_hostile import GOOD, media_root

__all__ = ["media_root"]
REDIS = "redis://127.0.0.1:6379/0"


def rejected(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("hclip_cache_rejected_total "):
            return float(line.split()[1])
    raise AssertionError("no hclip_cache_rejected_total")


def poisons(key: str) -> dict[str, bytes]:
    forged = orjson.dumps(
        {"index_version": "evil", "view": "vec", "results": [{"id": "x", "score": 1e9}]}
    )
    return {
        "garbage": b"garbage",
        "empty": b"",
        "forged": forged,
        "forged behind a MAC of another secret": b"\x00" * 32 + forged,
        "nan embedding": struct.pack("<4f", *([float("nan")] * 4)),
        "random embedding": np.random.default_rng(0).standard_normal(4, np.float32).tobytes(),
    }


@pytest.mark.parametrize("what", ["result", "embedding"])
def test_poisoned_cache_entries_are_misses(media_root: Path, what: str) -> None:
    prefix = f"hclip-test:{uuid.uuid4().hex}"
    r = redis.Redis.from_url(REDIS)
    query = {"image": GOOD["image"](3)}
    settings = settings_for(media_root, redis_url=REDIS, cache_prefix=prefix)
    with running(settings) as client:
        truth = client.post("/v1/search", json={"query": query, "k": 8}).json()
        assert truth["cached"] is False
        kind = "res" if what == "result" else "emb"
        (key,) = r.keys(f"{prefix}:{kind}:*")
        assert client.post("/v1/search", json={"query": query, "k": 8}).json()["cached"]
        for n, (name, value) in enumerate(poisons(key.decode()).items()):
            r.set(key, value, ex=60)
            # the result entry is poisoned under k = 8; the embedding entry under a new k,
            # whose result is not cached yet, so the poisoned embedding would be used
            k = 8 if what == "result" else 7 - n % 7
            got = client.post("/v1/search", json={"query": query, "k": k})
            assert got.status_code == 200, (name, got.text)
            body = got.json()  # valid JSON, the index's own answer
            assert body["cached"] is False, name
            assert body["index_version"] == truth["index_version"], name
            assert body["results"] == truth["results"][:k], name
            assert rejected(client) == n + 1, name
        assert r.get(key) is not None  # the miss stored a genuine entry again
    r.close()
