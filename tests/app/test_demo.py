"""The demo: its data, its pipeline on a tiny budget, and the search page in a real browser."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from app.demo import pipeline
from app.demo.cli import write_examples
from app.demo.data import HELD_OUT_VOICES, build_media, make_records, relevant
from indexer import artifact
from tests.app.browser import search_with_examples
from tests.app.conftest import running, settings_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo")


def test_media_keeps_held_out_apart(demo_dir: Path) -> None:
    media = build_media(demo_dir)
    assert build_media(demo_dir) == media  # the second call reuses what is there
    for kind in ("images", "clips", "texts"):
        parts = getattr(media, kind)
        train = {x for d in parts["train"] for x in d}
        held = {x for d in parts["held_out"] for x in d}
        assert train and held and not train & held, kind
    assert all(
        any(v.replace("+", "_") in c for v in HELD_OUT_VOICES)
        for d in media.clips["held_out"]
        for c in d
    )
    assert (demo_dir / media.clips["train"][7][0]).stat().st_size > 1000


def test_interaction_records_are_pairwise_independent(demo_dir: Path) -> None:
    media = build_media(demo_dir)
    rows = make_records("interaction", media, "train", 20000, 0, "t")
    d = {m: np.array([r["payload"]["digits"][m] for r in rows]) for m in ("image", "audio", "text")}
    assert relevant("interaction", d["image"], d["audio"], d["text"]).all()
    for x, y in (("image", "audio"), ("image", "text"), ("audio", "text")):
        joint = np.histogram2d(d[x], d[y], bins=10)[0] / len(rows)
        assert np.abs(joint - 0.01).max() < 0.004  # uniform: no pair carries information
    shared = make_records("shared", media, "train", 50, 0, "s")
    assert all(len(set(r["payload"]["digits"].values())) == 1 for r in shared)


def test_pipeline_on_a_tiny_budget(demo_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "N_TRAIN", 256)
    monkeypatch.setattr(pipeline, "N_GALLERY", 60)
    monkeypatch.setattr(pipeline, "N_QUERIES", 40)
    results = pipeline.run_all(demo_dir, epochs=1, progress=False)
    assert set(results["datasets"]) == {"shared", "interaction"}
    for heads in results["datasets"].values():
        assert set(heads) == {"hclip", "sum_of_pairs"}
        for rows in heads.values():
            assert set(rows) == {
                "image",
                "audio",
                "text",
                "audio+text",
                "image+text",
                "audio+image",
            }
            for r in rows.values():
                assert 0 <= r["hit@1"] <= r["hit@5"] <= r["hit@10"] <= 1
                assert 0.05 < r["chance_precision"] < 0.2
    assert "| `image` | hclip |" in (demo_dir / "results.md").read_text()
    assert (demo_dir / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert pipeline.run_all(demo_dir, epochs=1, progress=False) == results  # reused
    root = pipeline.ensure_index(demo_dir, "interaction")
    assert artifact.read_manifest(artifact.current_version_dir(root))["counts"]["records"] == 60
    write_examples(demo_dir)
    ex = json.loads((demo_dir / "examples.json").read_text())
    assert len(ex["image"]) == 20 and len(ex["audio"]) == 20 and len(ex["text"]) == 10


def test_page_shows_results_in_a_browser(demo_dir: Path, tmp_path: Path) -> None:
    root = demo_dir / "interaction" / "index"
    if artifact.read_current(root) is None:
        pytest.fail("needs the index of test_pipeline_on_a_tiny_budget")
    with running(settings_for(root, media_dir=demo_dir)) as client:
        assert client.get("/").text.startswith("<!doctype html>")
        assert client.get("/v1/demo/examples").status_code == 200
        media = client.get(json.loads((demo_dir / "examples.json").read_text())["image"][0]["url"])
        assert media.status_code == 200 and media.content[:4] == b"\x89PNG"
        assert client.get("/media/../../etc/passwd").status_code == 404
        shot = tmp_path / "page.png"
        texts = search_with_examples(str(client.base_url) + "/", shot, {"image": 0, "audio": 0})
    assert len(texts) == 10 and all(t.strip() for t in texts)
    assert shot.read_bytes()[:4] == b"\x89PNG"
    if os.environ.get("HCLIP_SAVE_SCREENSHOT"):
        shutil.copy(shot, REPO / os.environ["HCLIP_SAVE_SCREENSHOT"])


def test_examples_are_absent_outside_demo_mode(vector_index) -> None:
    root, _, _ = vector_index
    with running(settings_for(root)) as client:
        r = client.get("/v1/demo/examples")
        assert r.status_code == 404 and r.json()["error_type"] == "not_found"
        assert client.get("/static/app.js").status_code == 200
