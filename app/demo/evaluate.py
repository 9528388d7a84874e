"""Held-out retrieval of a trained model: every view's queries against the demo's gallery."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.demo.data import relevant
from models.encoders import decode
from models.heads import default_views, split_modalities, view_name
from models.limits import DEFAULT_LIMITS
from models.metrics import first_relevant_rank, hit_at
from models.model import MultimodalModel

MODALITIES = ("image", "audio", "text")
KS = (1, 5, 10)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def embed(
    model: MultimodalModel, rows: list[dict[str, Any]], base: Path
) -> dict[str, torch.Tensor]:
    # The records sit one level below the media they name (app.demo.data.make_records).
    limits = replace(DEFAULT_LIMITS, media_root=base.parent)
    out = {}
    for m in MODALITIES:
        items = [decode(r[m], model.cfg.modalities[m], base, limits) for r in rows]
        out[m] = torch.cat([model.encode(m, items[i : i + 256]) for i in range(0, len(items), 256)])
    return out


def evaluate(model: MultimodalModel, dataset: str, data: Path) -> dict[str, dict[str, float]]:
    """hit@1/5/10 and precision@10 per view, queries against the held-out gallery."""
    base = data / dataset
    queries, gallery = read_jsonl(base / "queries.jsonl"), read_jsonl(base / "gallery.jsonl")
    eq, eg = embed(model, queries, base), embed(model, gallery, base)
    qd = {m: np.array([r["payload"]["digits"][m] for r in queries]) for m in MODALITIES}
    gd = {m: np.array([r["payload"]["digits"][m] for r in gallery]) for m in MODALITIES}
    out = {}
    for view in default_views(model.names):
        q, t = split_modalities(model.names, view)
        scores = model.head.query_factor(eq, q) @ model.head.record_factor(eg, t).T  # (Nq, G)
        top = torch.topk(scores, max(KS), dim=1).indices.numpy()
        digits = {m: (qd[m][:, None] if m in q else gd[m][None, :]) for m in MODALITIES}
        rel = relevant(dataset, *(np.broadcast_to(digits[m], scores.shape) for m in MODALITIES))
        ranks = first_relevant_rank(scores, torch.from_numpy(rel)).numpy()  # (Nq,)
        # precision@10 is the demo's own: the share of relevant results among the first ten.
        hits = np.take_along_axis(rel, top, axis=1)  # (Nq, 10)
        p = float(rel.mean())
        row = {f"hit@{k}": hit_at(ranks, k) for k in KS}
        row |= {"precision@10": float(hits.mean()), "chance_precision": p}
        row |= {f"chance_hit@{k}": float(1 - (1 - p) ** k) for k in KS}
        out[view_name(view)] = row
    return out
