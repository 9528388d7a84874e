"""`embedding` modalities: the user's own tower's outputs, used as they are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError, ModalityConfig, ModelConfig
from models.encoders import decode
from models.heads import default_views, split_modalities
from models.limits import InputError
from models.model import MultimodalModel
from tests.conftest import run_cli, write_jsonl

DIMS = {"a": 6, "b": 5, "c": 4}


def emb_model(latent: int = 8, **mods: dict) -> dict:
    return {"modalities": mods, "latent_dim": latent}


@pytest.mark.parametrize(
    ("cfg", "field", "words"),
    [
        (
            emb_model(a={"kind": "embedding", "dim": 12}, b={"kind": "embedding", "dim": 8}),
            "modalities.a.dim",
            ["latent_dim (8)", '"map": "linear"'],
        ),
        (
            emb_model(a={"kind": "embedding"}, b={"kind": "embedding", "dim": 8}),
            "modalities.a.dim",
            ["required"],
        ),
        (
            emb_model(a={"kind": "embedding", "dim": 8, "map": "mlp"}, b={"kind": "text"}),
            "modalities.a.map",
            ["none, linear"],
        ),
        (
            emb_model(a={"kind": "vector", "dim": 8, "map": "linear"}, b={"kind": "text"}),
            "modalities.a.map",
            ["only embedding"],
        ),
    ],
)
def test_bad_embedding_configs_name_the_field(cfg: dict, field: str, words: list[str]) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}") as err:
        ModelConfig.from_dict(cfg)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_embedding_config_round_trips() -> None:
    cfg = ModelConfig.from_dict(
        emb_model(
            a={"kind": "embedding", "dim": 12, "map": "linear"},
            b={"kind": "embedding", "dim": 8},
        )
    )
    assert cfg.to_dict()["modalities"] == {
        "a": {"kind": "embedding", "dim": 12, "map": "linear"},
        "b": {"kind": "embedding", "dim": 8},
    }
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_without_a_map_the_encoder_only_normalises() -> None:
    cfg = ModelConfig.from_dict(
        emb_model(
            a={"kind": "embedding", "dim": 12, "map": "linear"},
            b={"kind": "embedding", "dim": 8},
        )
    )
    model = MultimodalModel(cfg)
    x = torch.randn(5, 8) * 3.0
    with torch.no_grad():
        torch.testing.assert_close(model.encode("b", list(x)), x / x.norm(dim=-1, keepdim=True))
        a = model.encode("a", list(torch.randn(5, 12)))
    assert a.shape == (5, 8)
    torch.testing.assert_close(a.norm(dim=-1), torch.ones(5))
    assert [n for n, _ in model.encoders.named_parameters()] == ["a.linear.weight"]


def test_embedding_inputs_are_checked() -> None:
    m = ModalityConfig(kind="embedding", dim=3)
    assert decode([1, 2, 3], m).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(InputError, match="embedding must have length 3, got 2"):
        decode([1.0, 2.0], m)
    with pytest.raises(InputError, match="all zeros"):
        decode([0.0, 0.0, 0.0], m)
    with pytest.raises(InputError, match="NaN or infinite"):
        decode([1.0, float("inf"), 0.0], m)


def shared_factor(
    n: int, seed: int, dims: dict[str, int] = DIMS, k: int = 16, noise: float = 0.5
) -> list[dict]:
    """Every modality a noisy view of one of k symbols, through fixed per-modality codebooks."""
    books = np.random.default_rng(0)
    book = {m: books.standard_normal((k, d)) for m, d in dims.items()}
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        s = int(rng.integers(0, k))
        row: dict = {"id": f"s{seed}-{i}", "payload": {"symbol": s}}
        for m, d in dims.items():
            row[m] = [round(float(v), 5) for v in book[m][s] + noise * rng.standard_normal(d)]
        rows.append(row)
    return rows


@torch.no_grad()
def embed_rows(model: MultimodalModel, rows: list[dict]) -> dict[str, torch.Tensor]:
    cfg = model.cfg.modalities
    return {m: model.encode(m, [decode(r[m], cfg[m]) for r in rows]) for m in model.names}


@torch.no_grad()
def hit_at_1(model: MultimodalModel, rows: list[dict]) -> dict[str, float]:
    """Per view: each record's query modalities against every other record's targets."""
    embs = embed_rows(model, rows)
    symbol = np.array([r["payload"]["symbol"] for r in rows])
    out = {}
    for view in default_views(model.names):
        q, t = split_modalities(model.names, view)
        scores = model.head.query_factor(embs, q) @ model.head.record_factor(embs, t).T
        scores.fill_diagonal_(-float("inf"))  # a record is not its own answer
        out["+".join(q)] = float((symbol[scores.argmax(1).numpy()] == symbol).mean())
    return out


def exported(model: MultimodalModel, rows: list[dict]) -> list[dict]:
    """The records with every modality replaced by the model's embedding of it."""
    embs = embed_rows(model, rows)
    return [
        {"id": r["id"], "payload": r["payload"], **{m: embs[m][i].tolist() for m in embs}}
        for i, r in enumerate(rows)
    ]


def train(tmp: Path, name: str, modalities: dict, records: list[dict], lr: float) -> Path:
    write_jsonl(tmp / f"{name}.jsonl", records)
    cfg = {
        "modalities": modalities,
        "latent_dim": 16,
        "train": {"records": f"{name}.jsonl", "epochs": 10, "batch_size": 64, "lr": lr},
    }
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    out = tmp / f"model-{name}"
    assert run_cli("train", "--config", tmp / f"{name}.json", "--out", out, "--quiet") == 0
    return out


def test_a_model_over_exported_embeddings_retrieves_as_well_as_the_original(
    tmp_path: Path,
) -> None:
    train_rows, held_out = shared_factor(512, seed=1), shared_factor(600, seed=2)
    vector = {m: {"kind": "vector", "dim": d, "hidden": 32} for m, d in DIMS.items()}
    original = load_model(train(tmp_path, "vector", vector, train_rows, lr=0.01))

    as_embeddings = {m: {"kind": "embedding", "dim": 16} for m in DIMS}
    new_dir = train(tmp_path, "embedding", as_embeddings, exported(original, train_rows), lr=0.01)
    new = load_model(new_dir)
    # Only omega and the logit scale were trained, and they did move from their start.
    assert sorted(k for k, _ in new.named_parameters()) == ["head.logit_scale", "head.weight"]
    final = json.loads((new_dir / "config.json").read_text())["training"]["final"]
    assert final["mi_bound_bits"] > 1.0

    before, after = hit_at_1(original, held_out), hit_at_1(new, exported(original, held_out))
    assert min(before.values()) > 0.5  # a task with room to fail, not a trivial one
    gaps = {v: abs(after[v] - before[v]) for v in before}
    assert np.mean(list(gaps.values())) <= 0.01, (before, after)
    assert max(gaps.values()) <= 0.02, (before, after)


def test_a_linear_map_is_learned_when_asked(tmp_path: Path) -> None:
    """Raw codebook vectors have no H-CLIP geometry: as they are, retrieval is at chance (1/16);
    a learned map from 10 to 16 dimensions finds one."""
    dims = {"a": 10, "b": 10, "c": 10}
    mapped = {m: {"kind": "embedding", "dim": 10, "map": "linear"} for m in dims}
    rows = shared_factor(512, seed=1, dims=dims, noise=0.3)
    trained = load_model(train(tmp_path, "mapped", mapped, rows, lr=0.01))
    torch.manual_seed(0)
    untrained = MultimodalModel(trained.cfg).eval()
    held_out = shared_factor(400, seed=2, dims=dims, noise=0.3)
    assert max(hit_at_1(untrained, held_out).values()) < 0.2
    assert min(hit_at_1(trained, held_out).values()) > 0.8
