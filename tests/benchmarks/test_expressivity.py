"""The expressivity benchmark's machinery on a tiny budget (the full run is `hclip bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks import expressivity as be
from models.heads import default_views


def test_views_follow_design_section_4() -> None:
    assert default_views(["b", "a"]) == [("a",), ("b",)]
    assert default_views(["c", "a", "b"]) == [
        ("a",),
        ("b",),
        ("c",),
        ("b", "c"),
        ("a", "c"),
        ("a", "b"),
    ]


def test_pure_interaction_pairs_are_independent() -> None:
    task = be.tasks(4)[1]
    sym = task.symbols(np.random.default_rng(0), 40000)
    for x, y in (("a", "b"), ("a", "c"), ("b", "c")):
        joint = np.histogram2d(sym[x], sym[y], bins=4)[0] / 40000
        assert np.abs(joint - 1 / 16).max() < 0.01
    assert task.relevant(sym).all()


def test_tiny_run_writes_results_table_and_plot(tmp_path: Path) -> None:
    s = be.BenchSettings(
        symbols=4,
        train_size=256,
        epochs=1,
        batch_size=64,
        queries=50,
        gallery=60,
        latent_dim=8,
        hidden=16,
        threads=1,
    )
    results = be.run(tmp_path, s, progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert (
        saved["tasks"].keys()
        == results["tasks"].keys()
        == {"shared_factor", "pure_interaction", "two_modalities"}
    )
    for runs in saved["tasks"].values():
        for r in runs.values():
            for v in r["views"].values():
                assert 0.0 <= v["top1"] <= 1.0 and 0.1 < v["chance"] < 0.5
    assert "| hclip |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "expressivity.png").read_bytes()[:4] == b"\x89PNG"


def test_a_queue_serves_the_full_conditional_runs(tmp_path: Path) -> None:
    s = be.BenchSettings(
        symbols=4,
        train_size=64,
        epochs=1,
        batch_size=8,
        queue_size=32,
        queries=20,
        gallery=20,
        latent_dim=8,
        hidden=8,
        threads=1,
    )
    results = be.run(tmp_path, s, progress=False, only=["pure_interaction"])
    runs = results["tasks"]["pure_interaction"]
    # log2(8 + 32) once the queue has filled; the pairwise baseline keeps log2(8)
    assert runs["hclip"]["ceiling_bits"] == np.log2(40)
    assert runs["sum_of_pairs (pairwise loss)"]["ceiling_bits"] == 3.0
    assert "a queue of 32 negatives" in (tmp_path / "results.md").read_text()
    assert set(runs) == {label for label, _, _ in be.HEAD_RUNS}
