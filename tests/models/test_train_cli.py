"""`hclip train` end to end on tiny data on the CPU, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from models.checkpoint import load_model
from tests.conftest import index_build, make_model_dir, vector_records, write_jsonl


def test_train_end_to_end(vector_config: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    assert main(["train", "--config", str(vector_config), "--out", str(out), "--quiet"]) == 0
    model = load_model(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["head"] == "hclip" and cfg["train"]["epochs"] == 2
    final = cfg["training"]["final"]
    assert final["step"] == 8 and final["mi_bound_bits"] <= final["ceiling_bits"] == 4.0
    assert model.names == ["a", "b", "c"]


def test_training_is_reproducible(vector_config: Path, tmp_path: Path) -> None:
    for name in ("m1", "m2"):
        assert (
            main(
                ["train", "--config", str(vector_config), "--out", str(tmp_path / name), "--quiet"]
            )
            == 0
        )
    assert (tmp_path / "m1/model.safetensors").read_bytes() == (
        tmp_path / "m2/model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r[2].update(a=[1.0, 2.0]), "line 3, id 'r-00002': a: vector must have length 6"),
        (
            lambda r: r[5].__setitem__("id", "r-00001"),
            "line 6, id 'r-00001': duplicate id, first seen on line 2",
        ),
        (
            lambda r: r[1].pop("c"),
            "line 2, id 'r-00001': modality 'c' is missing (the model needs all of a, b, c)",
        ),
    ],
)
def test_bad_records_name_the_line_and_leave_nothing(
    vector_config: Path, tmp_path: Path, capsys, mutate, message: str
) -> None:
    rows = vector_records(64, {"a": 6, "b": 5, "c": 4})
    mutate(rows)
    write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "model"
    assert main(["train", "--config", str(vector_config), "--out", str(out), "--quiet"]) == 2
    assert f"train.jsonl, {message}" in capsys.readouterr().err  # the file, its line, what
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_fields_the_model_lacks_are_left_out(vector_config: Path, tmp_path: Path, caplog) -> None:
    """Training on two of a file's modalities: the others are left out, in one line."""
    rows = vector_records(64, {"a": 6, "b": 5, "c": 4, "sound": 3})
    write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "model"
    assert main(["train", "--config", str(vector_config), "--out", str(out), "--quiet"]) == 0
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == [
        "ignored fields that are no modality of the model (a, b, c): 'sound' (first on line 1)"
    ]


def test_one_run_names_every_bad_line_as_the_build_names_them(
    vector_config: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`hclip train` names every bad line in one run, and names the file as `index build`
    does: relative to the working directory when inside it, else absolute."""
    rows = vector_records(64, {"a": 6, "b": 5, "c": 4})
    rows[2]["a"] = [1.0, 2.0]
    rows[5]["id"] = "r-00001"
    lines = [json.dumps(r) for r in rows]
    lines[9] = lines[9][:-20]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    model_dir = make_model_dir(tmp_path / "built")
    for cwd in (tmp_path, tmp_path.parent / "elsewhere"):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        name = "train.jsonl" if cwd == tmp_path else str(tmp_path / "train.jsonl")
        out = tmp_path / "model"
        assert main(["train", "--config", str(vector_config), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"hclip train: error: {name}: 3 bad records; fix them:",
            "  line 3, id 'r-00002': a: vector must have length 6, got 2",
            "  line 6, id 'r-00001': duplicate id, first seen on line 2",
            f"  line 10: not valid JSON: the line ends at column {len(lines[9])} with 2 brackets "
            "still open (is it cut short?)",
        ]
        assert not out.exists()
        assert index_build(model_dir, Path(name), tmp_path / "root") == 2
        build = capsys.readouterr().err.splitlines()
        assert build[0] == (
            f"hclip index build: error: {name}: 3 bad records; fix them, or pass --skip-bad to "
            "leave them out:"
        )
        assert build[1:] == err[1:]


def test_nan_in_a_record_is_refused(vector_config: Path, tmp_path: Path, capsys) -> None:
    rows = vector_records(64, {"a": 6, "b": 5, "c": 4})
    text = "".join(json.dumps(r) + "\n" for r in rows).replace(str(rows[7]["b"][0]), "NaN", 1)
    (tmp_path / "train.jsonl").write_text(text)
    assert (
        main(["train", "--config", str(vector_config), "--out", str(tmp_path / "m"), "--quiet"])
        == 2
    )
    assert "line 8, id 'r-00007': not valid JSON (NaN is not valid JSON)" in capsys.readouterr().err


def test_text_image_audio_model_trains(tmp_path: Path) -> None:
    """The real encoders, MiniLM included, on a handful of records."""
    from tests.models.test_inputs import data_uri, png_bytes, wav_bytes

    rows = [
        {
            "id": str(i),
            "text": f"sample number {i}",
            "image": data_uri("image/png", png_bytes()),
            "audio": data_uri("audio/wav", wav_bytes(seconds=0.1 + 0.01 * i)),
        }
        for i in range(8)
    ]
    write_jsonl(tmp_path / "r.jsonl", rows)
    cfg = {
        "modalities": {
            "text": {"kind": "text", "hidden": 16},
            "image": {"kind": "image", "image_size": 16, "hidden": 16},
            "audio": {"kind": "audio", "max_seconds": 0.2, "hidden": 16},
        },
        "latent_dim": 8,
        "train": {"records": "r.jsonl", "epochs": 1, "batch_size": 4},
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert (
        main(
            ["train", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "m"), "--quiet"]
        )
        == 0
    )
    model = load_model(tmp_path / "m")
    emb = model.encode("text", ["sample number 3"])
    assert emb.shape == (1, 8) and abs(float(emb.detach().norm()) - 1.0) < 1e-5
