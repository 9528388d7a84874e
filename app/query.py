"""Turning a request's raw inputs and embeddings into the query factor of its view."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import orjson
import torch

from app.cache import Cache
from app.errors import InvalidInput
from app.metrics import Metrics
from app.serving import ServingVersion
from models.inputs import InputError, decode
from models.model import MultimodalModel


def digest(obj: Any) -> str:
    """A hash of the canonical JSON form: key order and whitespace do not matter."""
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def check_raw(model: MultimodalModel, modality: str, value: Any) -> None:
    kind = model.cfg.modalities[modality].kind
    # A client must not make the server read its own files: media come inline only.
    if kind in ("image", "audio") and not (isinstance(value, str) and value.startswith("data:")):
        raise InvalidInput(f"query.{modality}: {kind} must be a base64 data: URI")


def check_embedding(modality: str, value: Any, d: int) -> torch.Tensor:
    field = f"embeddings.{modality}"
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise InvalidInput(f"{field}: expected a list of numbers")
    if len(value) != d:
        raise InvalidInput(
            f"{field}: expected {d} numbers (the model's latent d), got {len(value)}"
        )
    if not all(math.isfinite(v) for v in value):
        raise InvalidInput(f"{field}: holds NaN or infinite values")
    return torch.tensor(value, dtype=torch.float32)


async def encode_raw(
    serving: ServingVersion,
    modality: str,
    value: Any,
    cache: Cache,
    prefix: str,
    ttl_s: int,
    metrics: Metrics,
) -> torch.Tensor:
    """One query embedding, from the cache (keyed by model fingerprint and input) or encoded."""
    check_raw(serving.model, modality, value)
    key = f"{prefix}:emb:{serving.fingerprint}:{modality}:{digest(value)}"
    cached = await cache.get(key)
    d = serving.model.cfg.latent_dim
    if cached is not None and len(cached) == 4 * d:
        metrics.cache.labels(kind="embedding", outcome="hit").inc()
        return torch.from_numpy(np.frombuffer(cached, dtype=np.float32).copy())
    metrics.cache.labels(kind="embedding", outcome="miss").inc()
    emb = await serving.encoders[modality].submit(value)
    await cache.set(key, emb.tobytes(), ttl_s)
    return torch.from_numpy(emb)


def encode_batch_blocking(model: MultimodalModel, modality: str, values: list[Any]) -> np.ndarray:
    items = []
    for i, value in enumerate(values):
        check_raw(model, modality, value)
        try:
            items.append(decode(value, model.cfg.modalities[modality], base_dir=None))
        except InputError as exc:
            raise InvalidInput(f"inputs[{i}]: {exc}") from None
    with torch.no_grad():
        return model.encode(modality, items).numpy().astype(np.float32)
