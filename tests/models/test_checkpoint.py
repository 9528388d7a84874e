"""Model directories round-trip; pickles, corruption and mismatches are refused by name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import CheckpointError, fingerprint, load_model, save_model
from models.config import ModelConfig
from models.model import MultimodalModel

CFG = ModelConfig.from_dict(
    {
        "modalities": {
            "a": {"kind": "vector", "dim": 4, "hidden": 8},
            "b": {"kind": "image", "image_size": 8, "hidden": 8},
            "c": {"kind": "audio", "max_seconds": 0.1, "hidden": 8},
        },
        "latent_dim": 6,
    }
)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[MultimodalModel, Path]:
    torch.manual_seed(0)
    model = MultimodalModel(CFG).eval()
    return model, save_model(model, tmp_path / "m")


def test_round_trip_gives_identical_outputs(saved) -> None:
    model, path = saved
    loaded = load_model(path)
    x = {"a": torch.randn(3, 4), "b": torch.rand(3, 1, 8, 8), "c": torch.randn(3, 1600)}
    with torch.no_grad():
        for m in x:
            torch.testing.assert_close(loaded.encoders[m](x[m]), model.encoders[m](x[m]))
        torch.testing.assert_close(loaded.head.omega, model.head.omega)
    assert fingerprint(path) == fingerprint(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_fingerprint_changes_with_weights(saved, tmp_path: Path) -> None:
    model, path = saved
    with torch.no_grad():
        model.head.weight[0] += 1.0
    other = save_model(model, tmp_path / "m2")
    assert fingerprint(other) != fingerprint(path)


def test_fingerprints_of_models_without_plugins_are_unchanged(saved) -> None:
    """Published indexes record their model's fingerprint, and the service compares it: a model
    without plugins still hashes as it always did (its architecture's JSON, then its weights)."""
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    arch = json.dumps({k: cfg[k] for k in ("modalities", "head", "latent_dim")}, sort_keys=True)
    h = hashlib.sha256(arch.encode() + (path / "model.safetensors").read_bytes())
    assert fingerprint(path) == h.hexdigest()[:16]


def test_pickled_checkpoint_is_refused(saved) -> None:
    model, path = saved
    torch.save(model.state_dict(), path / "model.safetensors")
    with pytest.raises(CheckpointError, match="pickled"):
        load_model(path)


def test_truncated_checkpoint_is_refused(saved) -> None:
    _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"corrupt|truncated"):
        load_model(path)


def test_shape_mismatch_names_the_tensor(saved) -> None:
    _, path = saved
    state = load_file(str(path / "model.safetensors"))
    state["head.weight"] = torch.ones(7)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'head.weight' has shape \(7,\)"):
        load_model(path)


def test_nan_weights_are_refused(saved) -> None:
    _, path = saved
    state = load_file(str(path / "model.safetensors"))
    state["head.weight"][2] = float("nan")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'head.weight' holds NaN"):
        load_model(path)


def test_config_must_match_weights(saved) -> None:
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["latent_dim"] = 9
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config needs"):
        load_model(path)
    cfg["modalities"]["a"]["kind"] = "laser"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"modalities.a.kind"):
        load_model(path)


def test_missing_directory_and_non_empty_out(saved, tmp_path: Path) -> None:
    model, path = saved
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not empty"):
        save_model(model, path)
    save_model(model, path, overwrite=True)
    load_model(path)
