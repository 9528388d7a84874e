"""The demo: its data, its training recipe (reduced), its pipeline on a tiny budget, and the
search page in a real browser (picking, uploading and recording)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.demo import pipeline
from app.demo.cli import write_examples
from app.demo.data import (
    HELD_OUT_VOICES,
    TRAIN_VOICES,
    DemoError,
    build_media,
    ensure_espeak,
    make_records,
    relevant,
)
from app.demo.recipe import Recipe, model_config
from app.demo.report import markdown, summarise, summary_markdown
from app.demo.train import model_dir, train_stage
from app.demo.tuples import FreshTuples, media_pools
from indexer.store import artifact
from models.config import ModelConfig
from tests.app.browser import SearchPage, microphone_wav, search_with_examples
from tests.app.conftest import running, settings_for

REPO = Path(__file__).resolve().parents[2]
VIEWS = {"image", "audio", "text", "audio+text", "image+text", "audio+image"}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo")


def media_copy(src: Path, dst: Path) -> Path:
    """Another data directory with `src`'s media (synthesising them again takes a while)."""
    build_media(src)
    dst.mkdir()
    for name in ("images", "audio"):
        shutil.copytree(src / name, dst / name)
    shutil.copy(src / "media.json", dst / "media.json")
    return dst


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
    # no held-out accent or voice variant is heard in training
    held_parts = {p for v in HELD_OUT_VOICES for p in v.split("+")}
    assert not held_parts & {p for v in TRAIN_VOICES for p in v.split("+")}
    assert {len(d) for d in media.clips["train"]} == {len(TRAIN_VOICES) * 9}
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


def test_fresh_tuples_are_interaction_tuples_drawn_by_the_seed(demo_dir: Path) -> None:
    cfg = ModelConfig.from_dict(model_config(Recipe(), "hclip"))
    pools = media_pools(build_media(demo_dir), "train", cfg, demo_dir)
    digit_of = {
        m: np.concatenate([np.full(len(p), d) for d, p in enumerate(pool.by_digit)])
        for m, pool in pools.items()
    }
    tuples = FreshTuples(pools, "interaction", 20000, seed=5, speed_jitter=0.15)
    d = {m: digit_of[m][tuples.rows[m]] for m in ("image", "audio", "text")}
    assert relevant("interaction", d["image"], d["audio"], d["text"]).all()
    for x, y in (("image", "audio"), ("image", "text"), ("audio", "text")):
        joint = np.histogram2d(d[x], d[y], bins=10)[0] / len(tuples)
        assert np.abs(joint - 0.01).max() < 0.004
    # far more distinct tuples than a fixed set of a few thousand
    triples = np.stack([tuples.rows[m] for m in ("image", "audio", "text")], axis=1)
    assert len(np.unique(triples, axis=0)) > 19_900
    again = FreshTuples(pools, "interaction", 20000, seed=5, speed_jitter=0.15)
    other = FreshTuples(pools, "interaction", 20000, seed=6, speed_jitter=0.15)
    assert all((again.rows[m] == tuples.rows[m]).all() for m in tuples.rows)
    assert not (other.rows["image"] == tuples.rows["image"]).all()

    items, keys = tuples.batch([3, 1, 4])
    repeat, _ = tuples.batch([3, 1, 4])
    for m in ("image", "audio", "text"):
        assert (keys[m] == pools[m].keys[torch.from_numpy(tuples.rows[m][[3, 1, 4]])]).all()
    clip = pools["audio"].items[tuples.rows["audio"][3]]
    played = items["audio"][0]
    assert played.shape == clip.shape and torch.equal(played, repeat["audio"][0])
    assert not torch.equal(played, clip)  # played at another speed
    assert tuples.speed is not None and 1 / 1.15 <= tuples.speed.min() < tuples.speed.max() <= 1.15
    assert items["text"][0] == pools["text"].items[tuples.rows["text"][3]]


def test_a_seed_and_a_thread_count_give_the_same_model(demo_dir: Path, tmp_path: Path) -> None:
    data = media_copy(demo_dir, tmp_path / "data")
    recipe = Recipe().scaled(0.02)  # a few steps of each stage
    weights = []
    for seed in (3, 3, 4):
        for stage in recipe.stages:  # the interaction stage starts from the shared model
            train_stage(data, recipe, stage, "hclip", seed, progress=False)
        out = model_dir(data, "interaction", "hclip")
        weights.append(load_file(str(out / "model.safetensors")))
        for stage in recipe.stages:
            shutil.rmtree(model_dir(data, stage.dataset, "hclip"))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_the_interaction_stage_keeps_the_shared_convolutions(
    demo_dir: Path, tmp_path: Path
) -> None:
    data = media_copy(demo_dir, tmp_path / "data")
    recipe = Recipe().scaled(0.02)
    for stage in recipe.stages:
        train_stage(data, recipe, stage, "sum_of_pairs", 0, progress=False)
    shared = load_file(str(model_dir(data, "shared", "sum_of_pairs") / "model.safetensors"))
    inter = load_file(str(model_dir(data, "interaction", "sum_of_pairs") / "model.safetensors"))
    convs = [k for k in shared if ".cnn.0." in k or ".cnn.1." in k]  # the two conv blocks
    assert convs and all(torch.equal(shared[k], inter[k]) for k in convs)
    above = [k for k in shared if ".proj." in k]
    assert above and not any(torch.equal(shared[k], inter[k]) for k in above)


@pytest.mark.slow
def test_the_recipe_retrieves_the_interaction_and_sum_of_pairs_cannot(
    demo_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The demo's recipe at a reduced size (40% of the steps): H-CLIP retrieves the
    interaction in every view, sum-of-pairs stays near chance."""
    monkeypatch.setattr(pipeline, "N_GALLERY", 300)
    monkeypatch.setattr(pipeline, "N_QUERIES", 200)
    data = media_copy(demo_dir, tmp_path / "data")
    results = pipeline.run_all(data, Recipe().scaled(0.4), seed=0, progress=False)
    heads = results["datasets"]["interaction"]
    for view in VIEWS:
        hclip, sop = heads["hclip"][view]["hit@1"], heads["sum_of_pairs"][view]["hit@1"]
        chance = heads["hclip"][view]["chance_hit@1"]
        print(f"{view}: hclip {hclip:.3f}, sum_of_pairs {sop:.3f}, chance {chance:.3f}")
        assert hclip >= 0.8 and hclip - sop >= 0.5, (view, hclip, sop)
        assert sop < chance + 0.25, (view, sop, chance)
    for head, rows in results["datasets"]["shared"].items():
        assert min(r["hit@1"] for r in rows.values()) >= 0.8, head


def test_pipeline_on_a_tiny_budget(demo_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(pipeline, "N_GALLERY", 60)
    monkeypatch.setattr(pipeline, "N_QUERIES", 40)
    recipe = Recipe().scaled(0.02)
    results = pipeline.run_all(demo_dir, recipe, seed=0, progress=False)
    assert results["seed"] == 0 and results["recipe"] == recipe.to_dict()
    assert set(results["datasets"]) == {"shared", "interaction"}
    for heads in results["datasets"].values():
        assert set(heads) == {"hclip", "sum_of_pairs"}
        for rows in heads.values():
            assert set(rows) == VIEWS
            for r in rows.values():
                assert 0 <= r["hit@1"] <= r["hit@5"] <= r["hit@10"] <= 1
                assert 0.05 < r["chance_precision"] < 0.2
    for head in ("hclip", "sum_of_pairs"):
        assert set(results["seconds"][head]) == {"shared", "interaction"}
    assert "| `image` | hclip |" in (demo_dir / "results.md").read_text()
    assert (demo_dir / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert pipeline.run_all(demo_dir, recipe, seed=0, progress=False) == results  # reused
    root = pipeline.ensure_index(demo_dir, "interaction")
    assert artifact.read_manifest(artifact.current_version_dir(root))["counts"]["records"] == 60
    write_examples(demo_dir, "interaction")
    ex = json.loads((demo_dir / "examples.json").read_text())
    assert len(ex["image"]) == 20 and len(ex["audio"]) == 20 and len(ex["text"]) == 10


def test_a_directory_built_otherwise_is_rebuilt(tmp_path: Path) -> None:
    def layout() -> None:
        for name in ("shared", "interaction"):
            (tmp_path / name).mkdir(exist_ok=True)
        for name in ("media.json", "results.json", "examples.json"):
            (tmp_path / name).write_text("{}")

    layout()
    (tmp_path / "mine.txt").write_text("not the demo's")
    pipeline.ensure_fresh(tmp_path, Recipe(), 0)  # unknown origin: what it derived goes
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "shared").exists()
    layout()
    pipeline.ensure_fresh(tmp_path, Recipe(), 0)  # what built it: nothing goes
    assert (tmp_path / "results.json").exists() and (tmp_path / "shared").exists()
    pipeline.ensure_fresh(tmp_path, Recipe(), 1)  # another seed
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "shared").exists()
    # the media are data.py's: it redoes them when their own spec changes
    assert (tmp_path / "media.json").exists() and (tmp_path / "mine.txt").exists()
    assert json.loads((tmp_path / "build.json").read_text())["seed"] == 1


def test_summaries_over_seeds(demo_dir: Path) -> None:
    one = json.loads((demo_dir / "results.json").read_text())
    two = json.loads(json.dumps(one))
    two["seed"] = 7
    two["datasets"]["interaction"]["hclip"]["image"]["hit@1"] = 0.25
    one["datasets"]["interaction"]["hclip"]["image"]["hit@1"] = 0.75
    s = summarise([one, two])
    cell = s["datasets"]["interaction"]["hclip"]["image"]["hit@1"]
    assert cell == {"mean": 0.5, "min": 0.25, "max": 0.75}
    assert s["seeds"] == [0, 7] and s["runs"] == [one, two]
    text = summary_markdown(s)
    assert "| `image` | hclip | 0.500 (0.250-0.750) |" in text and "seeds 0, 7" in text
    assert "Seed 0;" in markdown(one)
    two["recipe"] = {**two["recipe"], "lr": 1.0}
    with pytest.raises(ValueError, match="different recipes"):
        summarise([one, two])


def test_espeak_is_installed_with_a_notice_not_apt_output(tmp_path: Path, monkeypatch, capfd):
    if os.geteuid() != 0:
        pytest.skip("the demo installs espeak-ng only as root")
    # An apt-get that talks as much as the real one and "installs" espeak-ng into our PATH.
    apt = tmp_path / "apt-get"
    apt.write_text(
        "#!/bin/sh\n"
        'echo "Reading package lists... Done"; echo "Setting up espeak-ng" >&2\n'
        f'if [ "$1" = install ]; then printf "#!/bin/sh\\n" > {tmp_path}/espeak-ng; '
        f"/bin/chmod +x {tmp_path}/espeak-ng; fi\n"
    )
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ensure_espeak() == str(tmp_path / "espeak-ng")
    out, err = capfd.readouterr()
    assert "installing espeak-ng" in out
    assert "Reading package lists" not in out + err and "Setting up" not in out + err

    (tmp_path / "espeak-ng").unlink()
    apt.write_text('#!/bin/sh\necho "E: Unable to locate package espeak-ng" >&2\nexit 100\n')
    with pytest.raises(DemoError, match="Unable to locate package"):
        ensure_espeak()


def test_a_taken_port_is_said_before_anything_is_built(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "app.cli", "demo", "--port", str(port)]
        cmd += ["--data-dir", str(tmp_path / "demo")]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert not (tmp_path / "demo").exists() and time.perf_counter() - t0 < 30


def test_page_picks_uploads_and_records_in_a_browser(demo_dir: Path, tmp_path: Path) -> None:
    root = demo_dir / "interaction" / "index"
    if artifact.read_current(root) is None:
        pytest.fail("needs the index of test_pipeline_on_a_tiny_budget")
    examples = json.loads((demo_dir / "examples.json").read_text())
    image = demo_dir / examples["image"][3]["url"].removeprefix("/media/")
    clip = demo_dir / examples["audio"][4]["url"].removeprefix("/media/")
    with running(settings_for(root, media_dir=demo_dir)) as client:
        assert client.get("/").text.startswith("<!doctype html>")
        assert client.get("/v1/demo/examples").status_code == 200
        media = client.get(examples["image"][0]["url"])
        assert media.status_code == 200 and media.content[:4] == b"\x89PNG"
        assert client.get("/media/../../etc/passwd").status_code == 404
        url = str(client.base_url) + "/"

        shot = tmp_path / "page.png"
        texts = search_with_examples(url, shot, {"image": 0, "audio": 0})
        assert len(texts) == 10 and all(t.strip() for t in texts)
        assert shot.read_bytes()[:4] == b"\x89PNG"

        with SearchPage(url, microphone=microphone_wav(demo_dir, 7, tmp_path)) as page:
            assert page.upload("image", image) == f"uploaded {image.name}"
            assert page.upload("audio", clip) == f"uploaded {clip.name}"
            texts = page.search()
            assert len(texts) == 10 and page.result_meta().startswith("view audio+image")
            # where the answer's time went, from its Server-Timing header
            took = re.search(r", in ([0-9.]+) ms \(encode (.+); search ([0-9.]+)\)$",
                             page.result_meta())  # fmt: skip
            assert took, page.result_meta()
            encodes = dict(e.split(" ") for e in took[2].split(", "))
            assert sorted(encodes) == ["audio", "image"], took[2]
            assert all(float(ms) <= float(took[1]) for ms in [*encodes.values(), took[3]])

            page.driver.find_element("css selector", "#mod-image h3 button").click()  # clear
            label = page.record("audio")
            seconds = float(label.removeprefix("your recording (").removesuffix(" s)"))
            # 2 s recorded; the silence before the word is cut, so the word starts the clip
            assert 0.5 < seconds < 1.9, label
            texts = page.search()
            assert len(texts) == 10 and page.result_meta().startswith("view audio,")
            page.screenshot(tmp_path / "recorded.png")

        with SearchPage(url) as page:
            # the spoken examples come in rows, one per voice, each labelled with it
            assert sorted(page.voices()) == sorted(HELD_OUT_VOICES), page.voices()
            # clear empties the text box: what is typed next is the whole query
            page.type_text("text", "exactly seven")
            page.clear("text")
            assert page.text_box("text") == ""
            assert page.type_text("text", "the number two") == '"the number two"'
            # the page states the task, and each card says what was retrieved and why it fits
            assert page.task().startswith("Each record pairs an image of a digit a, a spoken")
            # each card leads with what the view retrieved: image + text query the audio
            page.pick("image", 2)
            page.search()
            assert page.result_meta().startswith("view image+text, retrieving audio")
            for card in page.results():
                assert page.lead_and_minor(card) == (["audio"], ["image", "text"])
            top = page.card_meta()[0]
            assert "(retrieved)" in top and top.count("(retrieved)") == 1, top
            assert "✓ (" in top and "mod 10" in top, top
            # k is checked as the server checks it, in its words, before anything is sent
            for k in ("0", "2.5", "101"):
                page.set_k(k)
                assert page.search_failing() == (
                    f"invalid_input: k: must be between 1 and 100 (HCLIP_MAX_K), got {k}"
                )
            page.set_k("51")
            assert len(page.search()) == 51
            page.set_k("10")
            # a long text is not echoed whole
            page.clear("text")
            page.type_text("text", "seven " * 2000)
            assert len(page.chosen("text")) < 80, page.chosen("text")
            page.clear("text")
            page.type_text("text", "the number two")
            # an error replaces the answer before it: no stale results under the message
            page.pick("audio", 1)
            assert "nothing is left to retrieve" in page.search_failing()
            assert page.results() == [] and page.result_meta() == ""
        favicon = client.get("/favicon.ico")
    # With keys on, the media are guarded too: the page fetches them with the key it was given.
    with running(settings_for(root, media_dir=demo_dir, api_keys="sesame")) as keyed:
        assert keyed.get(examples["image"][0]["url"]).status_code == 401
        with SearchPage(str(keyed.base_url) + "/", key="sesame") as page:
            page.wait.until(lambda d: page.images_shown("[data-example=image]"))
            page.pick("image", 0)
            page.pick("audio", 0)
            assert len(page.search()) == 10
            page.wait.until(lambda d: page.images_shown("#results img"))
            # a phone's width: one column, nothing scrolls sideways
            page.driver.set_window_size(420, 900)
            narrow = tmp_path / "narrow.png"
            page.full_screenshot(narrow)
            assert png_width(narrow) <= 420, png_width(narrow)
            assert not page.overflows()
        assert favicon.status_code == 200 and favicon.headers["content-type"] == "image/svg+xml"
    if os.environ.get("HCLIP_SAVE_SCREENSHOT"):
        shutil.copy(shot, REPO / os.environ["HCLIP_SAVE_SCREENSHOT"])


def png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR's first field


def test_examples_are_absent_outside_demo_mode(vector_index) -> None:
    root, _, _ = vector_index
    with running(settings_for(root)) as client:
        r = client.get("/v1/demo/examples")
        assert r.status_code == 404 and r.json()["error_type"] == "not_found"
        assert client.get("/static/app.js").status_code == 200
