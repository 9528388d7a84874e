"""Held-out queries for the tuner: a JSON Lines file of search requests, one per line, as
POST /v1/search takes them (`{"query": {modality: raw}, "embeddings": {modality: [floats]}}`;
other keys are ignored), e.g. a sample of a service's own request log.

Each line becomes a query vector of the view its modalities name, formed as the server forms
it: raw inputs through the model's encoders, given embeddings as they are, then the head's
query factor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.encoders import decode
from models.heads import view_name
from models.limits import InputError
from models.model import MultimodalModel
from models.records import RecordError, iter_jsonl

ENCODE_BATCH = 256


def _line_inputs(
    model: MultimodalModel, obj: dict[str, Any], line: int, base: Path
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(decoded raw inputs, given embeddings) of one request line."""
    raw, given = obj.get("query") or {}, obj.get("embeddings") or {}
    if not isinstance(raw, dict) or not isinstance(given, dict):
        raise RecordError("'query' and 'embeddings' must be objects", line)
    unknown = sorted((set(raw) | set(given)) - set(model.names))
    if unknown or not raw.keys() | given.keys():
        what = f"unknown modality {unknown[0]!r}" if unknown else "no query modality"
        raise RecordError(f"{what} (model has: {', '.join(model.names)})", line)
    decoded = {}
    for m, value in raw.items():
        try:
            decoded[m] = decode(value, model.cfg.modalities[m], base)
        except InputError as exc:
            raise RecordError(f"query.{m}: {exc}", line) from None
    d = model.cfg.latent_dim
    embs = {}
    for m, value in given.items():
        arr = np.asarray(value, dtype=np.float32)
        if arr.shape != (d,) or not np.isfinite(arr).all():
            raise RecordError(f"embeddings.{m}: expected {d} finite numbers", line)
        embs[m] = torch.from_numpy(arr)
    return decoded, embs


@torch.no_grad()
def read_queries(
    path: Path, model: MultimodalModel, views: Sequence[str]
) -> tuple[dict[str, np.ndarray], int]:
    """({view name: (n, D) query vectors}, lines for views not asked for)."""
    lines: dict[str, list[tuple[dict[str, Any], dict[str, torch.Tensor]]]] = defaultdict(list)
    other = 0
    for line, obj in iter_jsonl(path):
        decoded, embs = _line_inputs(model, obj, line, path.parent)
        name = view_name([*decoded, *embs])
        if name in views:
            lines[name].append((decoded, embs))
        else:
            other += 1
    out = {}
    for name, items in lines.items():
        modalities = tuple(name.split("+"))
        parts = []
        for s in range(0, len(items), ENCODE_BATCH):
            batch = items[s : s + ENCODE_BATCH]
            parts.append(_factors(model, modalities, batch))
        out[name] = np.concatenate(parts).astype(np.float32)
    return out, other


def _factors(
    model: MultimodalModel,
    modalities: tuple[str, ...],
    batch: list[tuple[dict[str, Any], dict[str, torch.Tensor]]],
) -> np.ndarray:
    """Query factors of a batch of lines of one view; a line may give each modality raw or
    as an embedding, so each modality's raw inputs are encoded together and put in place."""
    embs = {}
    for m in modalities:
        rows: list[torch.Tensor | None] = [given.get(m) for _, given in batch]
        raw = [i for i, r in enumerate(rows) if r is None]
        if raw:
            encoded = model.encode(m, [batch[i][0][m] for i in raw])
            for j, i in enumerate(raw):
                rows[i] = encoded[j]
        embs[m] = torch.stack([r for r in rows if r is not None])
    return model.head.query_factor(embs, modalities).numpy()
