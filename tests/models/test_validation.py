"""Validation during training, `keep: best`, the experiment logs, and the ranking metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.heads_eval import interaction_records
from models.metrics import first_relevant_rank, own_rank, summarize
from tests.conftest import run_cli, write_jsonl

EPOCHS = 4


def test_ranks_match_a_sort_of_the_candidates() -> None:
    rng = np.random.default_rng(0)
    scores = torch.from_numpy(rng.standard_normal((50, 30)))
    relevant = torch.from_numpy(rng.random((50, 30)) < 0.1)
    ranks = first_relevant_rank(scores, relevant).numpy()
    for i in range(50):
        order = np.argsort(-scores[i].numpy())
        hits = np.flatnonzero(relevant[i].numpy()[order])
        assert ranks[i] == (hits[0] + 1 if len(hits) else np.inf)
    own = torch.from_numpy(rng.integers(0, 30, 50))
    eye = torch.zeros(50, 30, dtype=torch.bool)
    eye[torch.arange(50), own] = True
    assert np.array_equal(own_rank(scores, own).numpy(), first_relevant_rank(scores, eye).numpy())
    f = summarize(np.array([1.0, 2.0, 20.0, np.inf]), 40, (10,))
    assert (f["hit@1"], f["recall@10"], f["median_rank"]) == (0.25, 0.5, 11.0)
    assert f["mrr"] == pytest.approx((1 + 0.5 + 0.05) / 4)
    assert (f["chance@1"], f["chance@10"], f["n"]) == (1 / 40, 10 / 40, 4)


def _config(tmp: Path, **train: object) -> Path:
    write_jsonl(tmp / "train.jsonl", interaction_records(512, 6, 8, 0.1, seed=1))
    write_jsonl(tmp / "val.jsonl", interaction_records(96, 6, 8, 0.1, seed=2))
    cfg = {
        "modalities": {m: {"kind": "vector", "dim": 8, "hidden": 32} for m in "abc"},
        "head": "hclip",
        "latent_dim": 16,
        "train": {
            "records": "train.jsonl",
            "epochs": EPOCHS,
            "batch_size": 64,
            "lr": 0.01,
            "log_every": 2,
            "validation": {"records": "val.jsonl", "every": 1},
            **train,
        },
    }
    return write_jsonl(tmp / "config.json", [cfg])


def test_keep_best_keeps_the_best_validation_point(tmp_path: Path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(tmp_path, keep="best", log_dir="logs")
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 0
    figures = json.loads((tmp_path / "model" / "validation.json").read_text())
    points = figures["points"]
    assert [p["epoch"] for p in points] == [1.0, 2.0, 3.0, 4.0]  # every epoch
    views = {"a", "b", "c", "a+b", "a+c", "b+c"}
    for p in points:
        assert set(p["views"]) == views and p["views"]["a"]["n"] == 96
        assert p["mean_hit@1"] == pytest.approx(np.mean([v["hit@1"] for v in p["views"].values()]))
    best = max(p["mean_hit@1"] for p in points)
    assert figures["kept"]["mean_hit@1"] == best > 3 / 96  # well above chance (1/96)
    # The kept weights are the best point's: the saved model scores what was logged.
    capsys.readouterr()
    val = tmp_path / "val.jsonl"
    assert run_cli("eval", "--model", tmp_path / "model", "--records", val, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    for view, f in report["views"].items():
        assert f["hit@1"] == pytest.approx(figures["kept"]["views"][view]["hit@1"], abs=1.5 / 96)
    assert np.mean([f["hit@1"] for f in report["views"].values()]) == pytest.approx(best, abs=0.01)
    # The same rows beside the model and in the log directory; TensorBoard reads its files.
    beside = (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()
    logged = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in beside] == sorted(
        (json.loads(r) for r in logged), key=lambda r: (r["step"], r["kind"] == "validation")
    )
    assert sum(json.loads(r)["kind"] == "validation" for r in logged) == EPOCHS
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("loss", "mi_bound_bits", "lr", "logit_scale"):
        assert f"train/{tag}" in tags
    for view in views:
        for metric in ("hit@1", "recall@10", "mrr", "median_rank"):
            assert f"validation/views/{view}/{metric}" in tags
    hit = events.Scalars("validation/mean_hit@1")
    assert [round(e.value, 6) for e in hit] == [round(p["mean_hit@1"], 6) for p in points]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda tmp: write_jsonl(tmp / "val.jsonl", [{"id": "x", "a": [0.0] * 8, "b": [0.0] * 8}]),
         "val.jsonl, line 1, id 'x': modality 'c' is missing (the model needs all of a, b, c)"),
        (lambda tmp: (tmp / "val.jsonl").write_text(""), "val.jsonl: no records"),
    ],
)  # fmt: skip
def test_a_bad_validation_file_is_one_line(tmp_path: Path, capsys, change, expected) -> None:
    config = _config(tmp_path)
    change(tmp_path)
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hclip train: error: ")
    assert expected in err
    assert not (tmp_path / "model").exists()


def test_keep_best_needs_validation(tmp_path: Path, capsys) -> None:
    config = _config(tmp_path, keep="best")
    cfg = json.loads(config.read_text())
    del cfg["train"]["validation"]
    config.write_text(json.dumps(cfg))
    assert run_cli("train", "--config", config, "--out", tmp_path / "model", "--quiet") == 2
    err = capsys.readouterr().err
    assert "train.keep: 'best' needs train.validation" in err
