"""Shared fixtures: tiny synthetic models and records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _own_checked_dir(tmp_path_factory) -> None:
    """Servers the tests start (in process or not) remember checked versions and the exact
    search's kernel choice in directories of this session's, not in the user's cache."""
    import os

    os.environ["HCLIP_CHECKED_DIR"] = str(tmp_path_factory.mktemp("checked"))
    os.environ["HCLIP_KERNELS_DIR"] = str(tmp_path_factory.mktemp("kernels"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vector_records(n: int, dims: dict[str, int], seed: int = 0, k: int = 4) -> list[dict]:
    """Shared-factor records: every modality is a noisy view of one of k symbols."""
    rng = np.random.default_rng(seed)
    books = {m: rng.standard_normal((k, d)) for m, d in dims.items()}
    rows = []
    for i in range(n):
        s = int(rng.integers(0, k))
        row = {"id": f"r-{i:05d}", "payload": {"symbol": s}}
        for m, d in dims.items():
            row[m] = [round(float(v), 5) for v in books[m][s] + 0.1 * rng.standard_normal(d)]
        rows.append(row)
    return rows


@pytest.fixture
def vector_config(tmp_path: Path) -> Path:
    dims = {"a": 6, "b": 5, "c": 4}
    write_jsonl(tmp_path / "train.jsonl", vector_records(64, dims))
    cfg = {
        "modalities": {m: {"kind": "vector", "dim": d, "hidden": 16} for m, d in dims.items()},
        "head": "hclip",
        "latent_dim": 8,
        "train": {"records": "train.jsonl", "epochs": 2, "batch_size": 16, "lr": 0.01, "seed": 0},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


DIMS = {"a": 6, "b": 5, "c": 4}


def make_model_dir(
    path: Path,
    head: str = "hclip",
    dims: dict[str, int] | None = None,
    latent: int = 8,
    seed: int = 0,
) -> Path:
    """An untrained model with random weights (and a random omega): enough for index tests."""
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    dims = dims or DIMS
    cfg = ModelConfig.from_dict(
        {
            "modalities": {m: {"kind": "vector", "dim": d, "hidden": 16} for m, d in dims.items()},
            "head": head,
            "latent_dim": latent,
        }
    )
    torch.manual_seed(seed)
    model = MultimodalModel(cfg)
    with torch.no_grad():
        if head == "hclip":
            model.head.weight.copy_(torch.rand(latent) + 0.5)
        model.head.logit_scale.fill_(1.0)
    return save_model(model, path)


def run_cli(*argv: str) -> int:
    from app.cli import main

    return main([str(a) for a in argv])


def index_build(model: Path, records: Path, root: Path, *extra: object) -> int:
    """`hclip index build --quiet`, as a user types it."""
    return run_cli(
        "index", "build", "--model", model, "--records", records, "--root", root, "--quiet", *extra
    )
