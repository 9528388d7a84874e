"""Result and query-embedding caches: Redis when HCLIP_REDIS_URL is set, else an in-process LRU,
or none (HCLIP_CACHE_MAX_BYTES=0 without Redis: the search path then hashes nothing).

What comes back from Redis is trusted only when it carries the MAC this service wrote with it
(HMAC-SHA256 of the key and the value under HCLIP_CACHE_SECRET): the keys hold the index
version or the model fingerprint, so an entry is bound to what it was computed from, and
anything else that can write to Redis (a garbage value, an empty one, a forged answer or
embedding) only causes a miss, counted in hclip_cache_rejected_total and logged once.

Redis down or slow is never an error: a failed call (bounded by a short timeout) counts as a
miss, is logged and counted, and Redis is skipped for a short while so that a dead server does
not add its timeout to every request; after that the next call tries it again, so the cache
comes back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cachetools import TLRUCache

from app.core.metrics import Metrics

log = logging.getLogger(__name__)


class Cache(Protocol):
    backend: str

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_s: int) -> None: ...

    async def close(self) -> None: ...


# What an entry costs beyond its value's bytes: its key, the tuple, the cache's own records.
ENTRY_OVERHEAD = 256


class NoCache:
    """No cache: every get misses and nothing is kept. `SearchService` checks for it and skips
    the keys' hashing altogether."""

    backend = "off"

    async def get(self, key: str) -> bytes | None:
        return None

    async def set(self, key: str, value: bytes, ttl_s: int) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryCache:
    """cachetools' LRU with a per-entry expiry (TLRUCache), bounded in bytes (a result with
    k = 100 and large payloads is hundreds of kB, a query embedding about 1 kB); only touched
    from the event loop, so no lock."""

    backend = "memory"

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        # an entry is (its time to live, its bytes): it expires that long after it was set
        self._data: TLRUCache[str, tuple[int, bytes]] = TLRUCache(
            max_bytes,
            ttu=lambda _key, entry, now: now + entry[0],
            timer=time.monotonic,
            getsizeof=lambda entry: len(entry[1]) + ENTRY_OVERHEAD,
        )

    @property
    def nbytes(self) -> int:
        return int(self._data.currsize)

    async def get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        return None if entry is None else entry[1]

    async def set(self, key: str, value: bytes, ttl_s: int) -> None:
        if len(value) + ENTRY_OVERHEAD <= self.max_bytes:  # a larger one is not kept at all
            self._data[key] = (ttl_s, value)

    async def close(self) -> None:
        self._data.clear()


class RedisCache:
    backend = "redis"

    def __init__(self, url: str, timeout_s: float, retry_s: float, metrics: Metrics):
        from redis import asyncio as aioredis  # here: 0.1 s of start-up only where it is used
        from redis.exceptions import RedisError

        self._errors = (TimeoutError, RedisError, OSError)
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.metrics = metrics
        self._down_until = 0.0
        self._down = False

    def _failed(self, exc: BaseException) -> None:
        self.metrics.cache_errors.inc()
        self._down_until = time.monotonic() + self.retry_s
        if not self._down:
            log.warning("redis unavailable, serving uncached: %s", exc or type(exc).__name__)
        self._down = True

    def _ok(self) -> None:
        if self._down:
            log.warning("redis is back; caching again")
        self._down = False

    async def _call(self, coro_factory: Callable[[], Awaitable[Any]]) -> Any:
        if time.monotonic() < self._down_until:
            return None
        try:
            result = await asyncio.wait_for(coro_factory(), self.timeout_s * 2)
        except self._errors as exc:
            self._failed(exc)
            return None
        self._ok()
        return result

    async def get(self, key: str) -> bytes | None:
        value = await self._call(lambda: self.client.get(key))
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_s: int) -> None:
        await self._call(lambda: self.client.set(key, value, ex=ttl_s))

    async def close(self) -> None:
        with contextlib.suppress(*self._errors):
            await self.client.aclose()


MAC_BYTES = 32


class SignedCache:
    """Another cache's entries, each stored behind the MAC of its key and value."""

    def __init__(self, inner: Cache, secret: str, metrics: Metrics):
        self.inner = inner
        self.backend = inner.backend
        self._secret = secret.encode()
        self.metrics = metrics
        self._told = False

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.digest(self._secret, key.encode() + b"\0" + value, "sha256")

    async def get(self, key: str) -> bytes | None:
        raw = await self.inner.get(key)
        if raw is None:
            return None
        value = raw[MAC_BYTES:]
        if len(raw) >= MAC_BYTES and hmac.compare_digest(raw[:MAC_BYTES], self._mac(key, value)):
            return value
        self.metrics.cache_rejected.inc()
        if not self._told:
            self._told = True
            log.warning(
                "a cache entry failed its integrity check (written by something else, or under "
                "another HCLIP_CACHE_SECRET): treated as a miss; hclip_cache_rejected_total "
                "counts them (key %s)",
                key,
            )
        return None

    async def set(self, key: str, value: bytes, ttl_s: int) -> None:
        await self.inner.set(key, self._mac(key, value) + value, ttl_s)

    async def close(self) -> None:
        await self.inner.close()


def make_cache(
    redis_url: str | None,
    *,
    max_bytes: int,
    timeout_s: float,
    retry_s: float,
    metrics: Metrics,
    secret: str,
) -> Cache:
    if redis_url:  # shared with whatever else reaches it: entries are authenticated
        return SignedCache(RedisCache(redis_url, timeout_s, retry_s, metrics), secret, metrics)
    if max_bytes <= 0:
        return NoCache()
    return MemoryCache(max_bytes)  # this process's own memory: nothing else writes it
