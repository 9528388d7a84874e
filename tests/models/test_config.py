from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.config import ConfigError, ModelConfig, RunConfig


def model(**mods) -> dict:
    return {"modalities": mods, "latent_dim": 8}


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (model(a={"kind": "smell"}, b={"kind": "text"}), "modalities.a.kind"),
        (model(a={"kind": "vector"}, b={"kind": "text"}), "modalities.a.dim"),
        (model(a={"kind": "vector", "dim": 0}, b={"kind": "text"}), "modalities.a.dim"),
        (model(a={"kind": "vector", "dim": "4"}, b={"kind": "text"}), "modalities.a.dim"),
        (model(a={"kind": "text", "dim": 4}, b={"kind": "text"}), "modalities.a.dim"),
        (model(a={"kind": "text"}), "modalities"),
        (
            {**model(a={"kind": "text"}, b={"kind": "text"}, c={"kind": "text"}), "head": "clip"},
            "head",
        ),
        ({**model(a={"kind": "text"}, b={"kind": "text"}), "head": "dot"}, "head"),
        ({**model(a={"kind": "text"}, b={"kind": "text"}), "latent_dim": -1}, "latent_dim"),
        (model(a={"kind": "image", "channels": 2}, b={"kind": "text"}), "modalities.a.channels"),
        (model(a={"kind": "text", "colour": 1}, b={"kind": "text"}), "modalities.a.colour"),
    ],
)
def test_bad_model_config_names_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}"):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            model(a={"kind": "text", "hiden": 8}, b={"kind": "text"}),
            "modalities.a.hiden: unknown field (did you mean 'hidden'?) "
            "(kind 'text' takes: kind, hidden)",
        ),
        (
            model(a={"kind": "audio", "sample_rte": 8000}, b={"kind": "text"}),
            "modalities.a.sample_rte: unknown field (did you mean 'sample_rate'?) (kind 'audio' "
            "takes: kind, hidden, conv_width, sample_rate, max_seconds, n_mels, hop_ms)",
        ),
        (  # no near miss: the kind's own keys, still
            model(a={"kind": "vector", "dim": 3, "colour": 1}, b={"kind": "text"}),
            "modalities.a.colour: unknown field (kind 'vector' takes: kind, dim, hidden)",
        ),
        (  # no kind to go by: every key
            model(a={"kind": ["text"], "colour": 1}, b={"kind": "text"}),
            "modalities.a.colour: unknown field (allowed: channels, conv_width, dim, hidden, ",
        ),
    ],
)
def test_an_unknown_key_names_a_near_miss_and_only_its_kind_s_keys(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_dict(cfg)
    assert str(exc.value).startswith(message)


def test_an_unknown_train_key_names_a_near_miss(tmp_path: Path) -> None:
    cfg = {**model(a={"kind": "text"}, b={"kind": "text"}), "train": {"records": "r", "epoch": 3}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match=r"^train.epoch: unknown field \(did you mean 'epochs'\?\)"
    ):
        RunConfig.load(tmp_path / "c.json")


def test_model_config_round_trips() -> None:
    cfg = ModelConfig.from_dict(
        model(
            x={"kind": "vector", "dim": 3},
            i={"kind": "image", "image_size": 16},
            t={"kind": "text"},
        )
    )
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.names == ["i", "t", "x"]


def test_run_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        RunConfig.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  'x': 1}")
    with pytest.raises(ConfigError, match="line 2"):
        RunConfig.load(bad)
    ok = model(a={"kind": "vector", "dim": 2}, b={"kind": "vector", "dim": 2})
    bad.write_text(json.dumps({**ok, "train": {"epochs": 2}}))
    with pytest.raises(ConfigError, match=r"train.records"):
        RunConfig.load(bad)
    bad.write_text(json.dumps({**ok, "train": {"records": "r.jsonl", "loss": "pairwise"}}))
    with pytest.raises(ConfigError, match=r"train.loss"):
        RunConfig.load(bad)
    bad.write_text(json.dumps({**ok, "train": {"records": "r.jsonl", "lr": float("nan")}}))
    with pytest.raises(ConfigError, match=r"train.lr"):
        RunConfig.load(bad)
