"""Bad records name their line and id; nothing is published unless --skip-bad leaves them out."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from indexer.store import artifact
from models.records import MAX_REPORTED
from tests.conftest import index_build, make_model_dir, run_cli, write_jsonl

MODS = {
    "image": {"kind": "image", "image_size": 8, "hidden": 8},
    "audio": {"kind": "audio", "max_seconds": 0.1, "hidden": 8},
    "vec": {"kind": "vector", "dim": 3, "hidden": 8},
}


@pytest.fixture
def mm_model(tmp_path: Path) -> Path:
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    cfg = ModelConfig.from_dict({"modalities": MODS, "latent_dim": 4})
    return save_model(MultimodalModel(cfg), tmp_path / "mm")


def good(i: int) -> dict:
    from tests.models.test_inputs import data_uri, png_bytes, wav_bytes

    return {
        "id": f"g{i}",
        "image": data_uri("image/png", png_bytes()),
        "audio": data_uri("audio/wav", wav_bytes(seconds=0.05)),
        "vec": [i, 1.0, 2.0],
    }


CASES = [
    (lambda r: r.update(id="g1"), "line 3, id 'g1': duplicate id, first seen on line 2"),
    (lambda r: r.update(image="pics/nope.png"), "line 3, id 'g2': image: image file not found"),
    (
        lambda r: r.update(image="data:image/png;base64," + base64.b64encode(b"junk").decode()),
        "line 3, id 'g2': image: image could not be decoded",
    ),
    (
        lambda r: r.update(audio="data:audio/wav;base64," + base64.b64encode(b"RIFFjunk").decode()),
        "line 3, id 'g2': audio: audio could not be decoded",
    ),
    (lambda r: r.update(vec=[1.0, 2.0]), "line 3, id 'g2': vec: vector must have length 3, got 2"),
    (lambda r: r.update(vec=[1.0, 1e309, 2.0]), "line 3, id 'g2': not valid JSON (Infinity"),
    (
        lambda r: r.update(vec=None, image=None, audio=None, smell="roses"),
        "line 3, id 'g2': record has no modality of the model (audio, image, vec), only 'smell'",
    ),
    (lambda r: r.update(payload=[1]), "line 3, id 'g2': 'payload' must be a JSON object"),
    (lambda r: r.update(id=7), "line 3: 'id' must be a non-empty string"),
    (lambda r: r.update(vec="abc"), "line 3, id 'g2': vec: vector must be a list of numbers"),
    (lambda r: r.update(vec=[True, 1, 2]), "line 3, id 'g2': vec: vector must be a list of"),
    (lambda r: r.update(vec=None, image=None, audio=None), "line 3, id 'g2': record has no"),
]

# Lines that are not a record at all: the Validator sees them like any other bad line.
RAW_CASES = [
    (lambda line: line[:-5], "line 3: not valid JSON"),
    (lambda line: line.replace('"vec": [2, ', '"vec": [NaN, '), "line 3, id 'g2': not valid JSON"),
    (lambda line: "[1, 2, 3]", "line 3: expected a JSON object"),
    (lambda line: '"just a string"', "line 3: expected a JSON object"),
]


def write_raw(path: Path, mutate) -> None:
    lines = [json.dumps(good(i)) for i in range(4)]
    lines[2] = mutate(lines[2])
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("mutate", "message"), RAW_CASES)
def test_a_line_that_is_not_a_record_fails_the_build(
    tmp_path: Path, mm_model: Path, capsys, mutate, message: str
) -> None:
    write_raw(tmp_path / "r.jsonl", mutate)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root) == 2
    assert f"r.jsonl, {message}" in capsys.readouterr().err  # the file, its line, what is wrong
    assert artifact.read_current(root) is None


@pytest.mark.parametrize(("mutate", "message"), RAW_CASES)
def test_skip_bad_skips_a_line_that_is_not_a_record(
    tmp_path: Path, mm_model: Path, capsys, mutate, message: str
) -> None:
    write_raw(tmp_path / "r.jsonl", mutate)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root, "--skip-bad") == 0
    assert f"rejected {message}" in capsys.readouterr().out
    m = artifact.read_manifest(artifact.current_version_dir(root))
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1


@pytest.mark.parametrize(("mutate", "message"), CASES)
def test_bad_record_fails_the_build_and_publishes_nothing(
    tmp_path: Path, mm_model: Path, capsys, mutate, message: str
) -> None:
    rows = [good(i) for i in range(4)]
    mutate(rows[2])
    write_jsonl(tmp_path / "r.jsonl", rows)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root) == 2
    assert message in capsys.readouterr().err
    assert artifact.read_current(root) is None
    assert artifact.list_versions(root) == []
    assert not any((root / artifact.STAGING).iterdir())


def test_nan_literal_names_the_line(tmp_path: Path, mm_model: Path, capsys) -> None:
    lines = [json.dumps(good(0)), json.dumps(good(1)).replace('"vec": [1, ', '"vec": [NaN, ')]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    assert index_build(mm_model, tmp_path / "r.jsonl", tmp_path / "root") == 2
    assert "line 2, id 'g1': not valid JSON (NaN is not valid JSON)" in capsys.readouterr().err


@pytest.mark.parametrize(("mutate", "message"), CASES)
def test_skip_bad_leaves_each_kind_of_bad_record_out(
    tmp_path: Path, mm_model: Path, capsys, mutate, message: str
) -> None:
    rows = [good(i) for i in range(4)]
    mutate(rows[2])
    write_jsonl(tmp_path / "r.jsonl", rows)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root, "--skip-bad") == 0
    assert f"rejected {message}" in capsys.readouterr().out
    vdir = artifact.current_version_dir(root)
    m = artifact.read_manifest(vdir)
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1
    listed = [json.loads(x) for x in (vdir / m["rejected_file"]).read_text().splitlines()]
    assert listed == m["rejected"] and listed[0]["line"] == 3


def test_skip_bad_reports_and_leaves_them_out(tmp_path: Path, mm_model: Path, capsys) -> None:
    rows = [good(i) for i in range(6)]
    rows[2]["vec"] = [1.0]
    rows[4] = {"id": "g4", "vec": None, "sound": "roses"}
    rows[5]["id"] = "g0"
    write_jsonl(tmp_path / "r.jsonl", rows)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root, "--skip-bad") == 0
    out = capsys.readouterr().out
    assert "rejected line 3, id 'g2': vec: vector must have length 3" in out
    assert "rejected line 5, id 'g4': record has no modality of the model" in out
    assert "rejected line 6, id 'g0': duplicate id, first seen on line 1" in out
    m = artifact.read_manifest(artifact.current_version_dir(root))
    assert m["counts"] == {
        "records": 3,
        "by_modality": {"audio": 3, "image": 3, "vec": 3},
        "rejected": 3,
    }


def test_one_run_names_every_bad_line_up_to_a_limit(tmp_path: Path, mm_model: Path, capsys) -> None:
    """Without --skip-bad, one run names every bad line in order (a truncated one at its end),
    so a file is fixed in one pass; a file of nothing but bad lines stops at the limit."""
    lines = [json.dumps(good(i)) for i in range(8)]
    lines[1] = lines[1][: lines[1].index("data:audio") + 50]  # cut inside the audio's data URI
    lines[4] = json.dumps({**good(4), "vec": [1.0]})
    lines[6] = json.dumps({**good(6), "id": "g0"})
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root) == 2
    err = capsys.readouterr().err.splitlines()
    at = next(i for i, x in enumerate(err) if "3 bad records" in x)
    assert err[at].endswith(
        "r.jsonl: 3 bad records; fix them, or pass --skip-bad to leave them out:"
    )
    end = len(lines[1])
    assert err[at + 1 :] == [
        f"  line 2: not valid JSON: the line ends at column {end} inside a string that starts "
        f"at column {lines[1].index('data:audio')} (is it cut short?)",  # its opening quote
        "  line 5, id 'g4': vec: vector must have length 3, got 1",
        "  line 7, id 'g0': duplicate id, first seen on line 1",
    ]
    assert artifact.read_current(root) is None and artifact.list_versions(root) == []

    # nothing but bad lines: checking stops at the limit; one mistake throughout is said once
    bad = [json.dumps({**good(i), "vec": [1.0]}) if i % 2 else "[1]" for i in range(30)]
    (tmp_path / "all-bad.jsonl").write_text("\n".join(bad) + "\n")
    assert index_build(mm_model, tmp_path / "all-bad.jsonl", root) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(
        f"the first {MAX_REPORTED} bad records (checking stopped there); fix them, or pass "
        "--skip-bad to leave them out:"
    )
    assert len(err) == 1 + MAX_REPORTED and err[-1].startswith(f"  line {MAX_REPORTED}, id ")
    (tmp_path / "same.jsonl").write_text("[1]\n" * (MAX_REPORTED + 5))
    assert index_build(mm_model, tmp_path / "same.jsonl", root) == 2
    lines = ", ".join(str(i) for i in range(1, MAX_REPORTED + 1))
    assert capsys.readouterr().err.endswith(
        f"same.jsonl: lines {lines} and maybe more (checking stopped there): "
        "expected a JSON object\n"
    )


def test_fields_the_model_lacks_are_left_out_and_named_once(
    tmp_path: Path, mm_model: Path, caplog
) -> None:
    """A file may hold more modalities than the model: they are left out, in one line."""
    rows = [{**good(i), "sound": [1, 2], "captoin": "x"} for i in range(4)]
    write_jsonl(tmp_path / "r.jsonl", rows)
    root = tmp_path / "root"
    assert index_build(mm_model, tmp_path / "r.jsonl", root) == 0
    err = caplog.text
    assert err.count("ignored fields") == 1, err
    assert (
        "ignored fields that are no modality of the model (audio, image, vec): "
        "'captoin' (first on line 1), 'sound' (first on line 1)"
    ) in err
    m = artifact.read_manifest(artifact.current_version_dir(root))
    assert m["counts"]["records"] == 4 and m["counts"]["rejected"] == 0


def test_vector_model_with_a_missing_records_file(tmp_path: Path, capsys) -> None:
    model = make_model_dir(tmp_path / "m")
    assert (
        run_cli(
            "index",
            "build",
            "--model",
            model,
            "--records",
            tmp_path / "none.jsonl",
            "--root",
            tmp_path / "root",
        )
        == 2
    )
    assert "records file not found" in capsys.readouterr().err
