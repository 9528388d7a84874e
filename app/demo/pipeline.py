"""The demo's pipeline: dataset, models, evaluation and index, each built once and reused.

Every step writes under the data directory and is skipped when its output is already there, so
the first `hclip demo` builds everything and later starts go straight to serving.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.demo.data import DATASETS, build_media, make_records, relevant, write_jsonl
from indexer import artifact
from indexer.build import JobOptions, build
from models.checkpoint import load_model, save_model
from models.config import RunConfig
from models.data import load_training_records
from models.extras import require
from models.heads import default_views, split_modalities, view_name
from models.inputs import decode
from models.model import MultimodalModel
from models.training import train_model

log = logging.getLogger(__name__)

HEADS = ("hclip", "sum_of_pairs")
MODALITIES = ("image", "audio", "text")
N_TRAIN, N_GALLERY, N_QUERIES = 4000, 500, 400
KS = (1, 5, 10)


def model_config(head: str, epochs: int) -> dict[str, Any]:
    return {
        "modalities": {
            "image": {"kind": "image", "image_size": 16, "conv_width": 16, "hidden": 128},
            "audio": {
                "kind": "audio",
                "sample_rate": 8000,
                "max_seconds": 0.8,
                "n_mels": 24,
                "hop_ms": 20.0,
                "conv_width": 16,
                "hidden": 128,
            },
            "text": {"kind": "text", "hidden": 128},
        },
        "head": head,
        "latent_dim": 64,
        "train": {
            "records": "train.jsonl",
            "epochs": epochs,
            "batch_size": 64,
            "lr": 0.002,
            "seed": 0,
            "num_threads": 2,
        },
    }


def prepare_records(data: Path) -> None:
    media = build_media(data)
    for i, dataset in enumerate(DATASETS):
        d = data / dataset
        d.mkdir(exist_ok=True)
        if not (d / "gallery.jsonl").exists():
            write_jsonl(
                d / "train.jsonl", make_records(dataset, media, "train", N_TRAIN, 10 + i, "t")
            )
            write_jsonl(
                d / "queries.jsonl",
                make_records(dataset, media, "held_out", N_QUERIES, 20 + i, "q"),
            )
            write_jsonl(
                d / "gallery.jsonl",
                make_records(dataset, media, "held_out", N_GALLERY, 30 + i, dataset[0]),
            )


def train(data: Path, dataset: str, head: str, epochs: int, progress: bool) -> Path:
    out = data / dataset / f"model-{head}"
    if (out / "model.safetensors").exists():
        return out
    cfg_path = data / dataset / f"config-{head}.json"
    cfg_path.write_text(json.dumps(model_config(head, epochs), indent=2))
    cfg = RunConfig.load(cfg_path)
    t0 = time.perf_counter()
    records = load_training_records(cfg.records_path, cfg.model)
    result = train_model(cfg.model, cfg.train, records, progress=progress)
    log.info("trained %s on %s in %.0f s", head, dataset, time.perf_counter() - t0)
    extra = {"train": cfg.to_dict()["train"], "training": result.summary()}
    return save_model(result.model, out, extra=extra, overwrite=True)


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def _embed(
    model: MultimodalModel, rows: list[dict[str, Any]], base: Path
) -> dict[str, torch.Tensor]:
    out = {}
    for m in MODALITIES:
        items = [decode(r[m], model.cfg.modalities[m], base) for r in rows]
        out[m] = torch.cat([model.encode(m, items[i : i + 256]) for i in range(0, len(items), 256)])
    return out


def evaluate(model: MultimodalModel, dataset: str, data: Path) -> dict[str, dict[str, float]]:
    """hit@1/5/10 and precision@10 per view, queries against the held-out gallery."""
    queries, gallery = (
        _read(data / dataset / "queries.jsonl"),
        _read(data / dataset / "gallery.jsonl"),
    )
    base = data / dataset
    eq, eg = _embed(model, queries, base), _embed(model, gallery, base)
    qd = {m: np.array([r["payload"]["digits"][m] for r in queries]) for m in MODALITIES}
    gd = {m: np.array([r["payload"]["digits"][m] for r in gallery]) for m in MODALITIES}
    out = {}
    for view in default_views(model.names):
        q, t = split_modalities(model.names, view)
        scores = model.head.query_factor(eq, q) @ model.head.record_factor(eg, t).T  # (Nq, G)
        top = torch.topk(scores, max(KS), dim=1).indices.numpy()
        digits = {m: (qd[m][:, None] if m in q else gd[m][None, :]) for m in MODALITIES}
        rel = relevant(dataset, *(np.broadcast_to(digits[m], scores.shape) for m in MODALITIES))
        hits = np.take_along_axis(rel, top, axis=1)  # (Nq, 10)
        p = float(rel.mean())
        row = {f"hit@{k}": float(hits[:, :k].any(axis=1).mean()) for k in KS}
        row |= {"precision@10": float(hits.mean()), "chance_precision": p}
        row |= {f"chance_hit@{k}": float(1 - (1 - p) ** k) for k in KS}
        out[view_name(view)] = row
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Demo results: digits shown, spoken and written",
        "",
        "Held-out images, voices and sentences; a result is relevant when its digits agree "
        "with the query's (same digit in `shared`, (image + audio) mod 10 = text in "
        "`interaction`). Chance is the gallery's share of relevant records.",
        "",
    ]
    for dataset, heads in results["datasets"].items():
        lines += [
            f"## {dataset}",
            "",
            "| query | head | hit@1 | hit@5 | hit@10 | precision@10 | chance p@10 "
            "| chance hit@10 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        views = list(next(iter(heads.values())))
        for view in views:
            for head, rows in heads.items():
                r = rows[view]
                lines.append(
                    f"| `{view}` | {head} | {r['hit@1']:.3f} | {r['hit@5']:.3f} | "
                    f"{r['hit@10']:.3f} | {r['precision@10']:.3f} | {r['chance_precision']:.3f} | "
                    f"{r['chance_hit@10']:.3f} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    require("matplotlib", "demo", "the demo's results plot").use("Agg")
    import matplotlib.pyplot as plt

    datasets = results["datasets"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(12, 4.2), squeeze=False)
    for ax, (dataset, heads) in zip(axes[0], datasets.items(), strict=True):
        views = list(next(iter(heads.values())))
        for i, (head, rows) in enumerate(heads.items()):
            xs = np.arange(len(views)) + (i - 0.5) * 0.4
            ax.bar(xs, [rows[v]["precision@10"] for v in views], 0.4, label=head)
        chance = next(iter(heads.values()))
        for j, v in enumerate(views):
            ax.hlines(
                chance[v]["chance_precision"], j - 0.45, j + 0.45, colors="k", linestyles="dashed"
            )
        ax.set_xticks(np.arange(len(views)), [f"query {v}" for v in views], rotation=30)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("precision@10 (held out)")
        ax.set_title(f"{dataset} (dashed: chance)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_all(data: Path, epochs: int, progress: bool) -> dict[str, Any]:
    """Train and evaluate both heads on both datasets; results under data/results.*"""
    prepare_records(data)
    results_path = data / "results.json"
    if results_path.exists():
        return dict(json.loads(results_path.read_text()))
    results: dict[str, Any] = {"epochs": epochs, "datasets": {}}
    for dataset in DATASETS:
        results["datasets"][dataset] = {}
        for head in HEADS:
            model = load_model(train(data, dataset, head, epochs, progress))
            results["datasets"][dataset][head] = evaluate(model, dataset, data)
    (data / "results.md").write_text(markdown(results))
    plot(results, data / "results.png")
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def ensure_index(data: Path, dataset: str) -> Path:
    """The served index: the H-CLIP model over the dataset's held-out gallery."""
    root = data / dataset / "index"
    if artifact.read_current(root) is None:
        build(
            data / dataset / "model-hclip",
            data / dataset / "gallery.jsonl",
            root,
            JobOptions(progress=False),
        )
    return root
