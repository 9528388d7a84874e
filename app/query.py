"""Turning a request's raw inputs and embeddings into the query factor of its view."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import orjson
import torch

from app.batching import as_api_error
from app.cache import Cache
from app.errors import DeadlineExceeded, InvalidInput, Unanswerable
from app.metrics import Metrics
from app.serving import ServingVersion
from models.inputs import FLOAT32_MAX, InputError, InputLimits, decode

OFF_LOOP_BYTES = 1 << 16  # hashlib releases the GIL on large inputs: hash those on a thread


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:32]


def digest(obj: Any) -> str:
    """A hash of the canonical JSON form: key order and whitespace do not matter."""
    return _sha(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS))


async def input_digest(value: Any) -> str:
    """The hash of one raw input, computed once per request: the embedding cache's key, and a
    part of the result cache's. A megabyte of base64 takes a millisecond to hash; the event
    loop does not wait for it."""
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else orjson.dumps(value)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_sha, raw)
    return _sha(raw)


@contextlib.asynccontextmanager
async def deadline(seconds: float, metrics: Metrics) -> AsyncIterator[None]:
    """A request that runs past `seconds` gives up with a 503; work it queued is dropped."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        metrics.overloaded.labels(reason="deadline").inc()
        raise DeadlineExceeded(
            f"the request took longer than {seconds:g} s (HCLIP_REQUEST_TIMEOUT_S)"
        ) from None


def query_modalities(
    serving: ServingVersion, raw: Sequence[str], given: Sequence[str]
) -> tuple[str, ...]:
    names = serving.model.names
    both = sorted(set(raw) & set(given))
    if both:
        raise InvalidInput(f"query.{both[0]}: given both raw and as an embedding")
    modalities = tuple(sorted(set(raw) | set(given)))
    for m in modalities:
        if m not in names:
            field = "query" if m in raw else "embeddings"
            raise InvalidInput(
                f"{field}.{m}: unknown modality {m!r} (model has: {', '.join(names)})"
            )
    if not modalities:
        raise InvalidInput("query: names no modality: give 'query' or 'embeddings'")
    if len(modalities) == len(names):
        raise Unanswerable("the query names every modality: nothing is left to retrieve")
    return modalities


def check_raw(
    serving: ServingVersion, modality: str, value: Any, field: str, limits: InputLimits
) -> Any:
    """What can be checked of a raw input before it is queued: its type, and for the cheap
    kinds (texts, vectors) the value itself. Media are decoded by their encoder's thread.

    Returns the decoded input of a `vector` modality (its encoder runs inline and takes it as
    it is, instead of decoding the numbers a second time), else None."""
    cfg = serving.model.cfg.modalities[modality]
    # A client must not make the server read its own files: media come inline only.
    if cfg.kind in ("image", "audio"):
        if not (isinstance(value, str) and value.startswith("data:")):
            raise InvalidInput(f"{field}: {cfg.kind} must be a base64 data: URI")
    elif cfg.kind in ("text", "vector", "embedding"):
        try:
            decoded = decode(value, cfg, base_dir=None, limits=limits)
        except InputError as exc:
            raise as_api_error(field, exc) from None
        return decoded if cfg.kind == "vector" else None
    return None


def check_embedding(field: str, value: list[float], d: int, max_abs: float) -> torch.Tensor:
    if len(value) != d:
        raise InvalidInput(
            f"{field}: expected {d} numbers (the model's latent d), got {len(value)}"
        )
    if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in value):
        raise InvalidInput(f"{field}: holds NaN, infinite or out-of-float32-range values")
    if any(abs(v) > max_abs for v in value):
        raise InvalidInput(f"{field}: holds a number beyond +-{max_abs:g} (HCLIP_MAX_ABS_VALUE)")
    return torch.tensor(value, dtype=torch.float32)


async def encode_one(serving: ServingVersion, modality: str, value: Any, field: str) -> np.ndarray:
    """One raw input through its modality's batcher; its own error names `field`."""
    try:
        return await serving.encoders[modality].submit(value)
    except InputError as exc:
        raise as_api_error(field, exc) from None


async def encode_raw(
    serving: ServingVersion,
    modality: str,
    value: Any,
    value_digest: str,
    cache: Cache,
    prefix: str,
    ttl_s: int,
    metrics: Metrics,
) -> torch.Tensor:
    """One query embedding, from the cache (keyed by model fingerprint and input) or encoded.

    Encoders that run inline (vectors) are cheaper than a cache round trip and skip the cache.
    """
    field = f"query.{modality}"
    if serving.encoders[modality].executor is None:
        return torch.from_numpy(await encode_one(serving, modality, value, field))
    key = f"{prefix}:emb:{serving.fingerprint}:{modality}:{value_digest}"
    cached = await cache.get(key)
    d = serving.model.cfg.latent_dim
    if cached is not None and len(cached) == 4 * d:
        metrics.cache.labels(kind="embedding", outcome="hit").inc()
        return torch.from_numpy(np.frombuffer(cached, dtype=np.float32).copy())
    metrics.cache.labels(kind="embedding", outcome="miss").inc()
    emb = await encode_one(serving, modality, value, field)
    await cache.set(key, emb.tobytes(), ttl_s)
    return torch.from_numpy(emb)
