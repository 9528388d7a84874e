"""A NUL or a lone surrogate in any string a record gives (its id, a media path, a filter field's
value) is a bad record naming line, id and field, never a crash: --skip-bad leaves it out and
the version (its manifest and rejected list, which name the id) is written; the fast JSON and
Parquet paths of indexer.ingest.checks refer such records as the reference does, and training
refuses them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from indexer.store import artifact
from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl
from tests.indexer.test_records_confined import model, tree

__all__ = ["model", "tree"]  # fixtures shared with the media-root tests

NUL = "holds a NUL character (\\u0000)"
SURROGATE = "holds a lone surrogate (\\ud800), which UTF-8 cannot encode"

# (how the third record is spoiled, what its rejection says after "line 3, ")
CASES = [
    ("nul in id", lambda r: r.update(id="g\x002"), f"id 'g\\x002': 'id' {NUL}"),
    ("surrogate in id", lambda r: r.update(id="g\ud800"), f"id 'g\\\\ud800': 'id' {SURROGATE}"),
    ("nul in path", lambda r: r.update(image="pics/2\x00.png"), f"id 'g2': image: the value {NUL}"),
    (
        "surrogate in path",
        lambda r: r.update(image="pics/\ud800.png"),
        f"id 'g2': image: the value {SURROGATE}",
    ),
    (
        "nul in a filter field",
        lambda r: r["payload"].update(color="re\x00d"),
        f"id 'g2': payload.color: {NUL}",
    ),
    (
        "surrogate in a filter field",
        lambda r: r["payload"].update(color="re\ud800d"),
        "id 'g2': payload: cannot be stored (str is not valid UTF-8: surrogates not allowed)",
    ),
]


def spoiled(tree: Path, mutate) -> Path:
    rows = [
        {"id": f"g{i}", "image": f"pics/{i}.png", "vec": [i, 1, 2], "payload": {"color": "red"}}
        for i in range(4)
    ]
    mutate(rows[2])
    return write_jsonl(tree / "recs/r.jsonl", rows)  # json.dumps writes \u0000 and \ud800


@pytest.mark.parametrize(("name", "mutate", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_nul_or_a_lone_surrogate_fails_the_build_in_one_line(
    tree: Path, model: Path, capsys, name, mutate, message: str
) -> None:
    path = spoiled(tree, mutate)
    assert index_build(model, path, tree / "root", "--filter-fields", "color") == 2
    err = capsys.readouterr().err
    assert f"r.jsonl, line 3, {message}" in err and "Traceback" not in err, err
    assert artifact.read_current(tree / "root") is None


@pytest.mark.parametrize(("name", "mutate", "message"), CASES, ids=[c[0] for c in CASES])
def test_skip_bad_leaves_a_nul_or_a_lone_surrogate_out(
    tree: Path, model: Path, capsys, name, mutate, message: str
) -> None:
    path = spoiled(tree, mutate)
    root = tree / "root"
    assert index_build(model, path, root, "--filter-fields", "color", "--skip-bad") == 0
    assert f"rejected line 3, {message}" in capsys.readouterr().out
    vdir = artifact.current_version_dir(root)
    m = artifact.read_manifest(vdir)
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1
    listed = [json.loads(x) for x in (vdir / m["rejected_file"]).read_text().splitlines()]
    assert listed == m["rejected"] and listed[0]["line"] == 3


def vector_rows() -> list[dict]:
    rows = vector_records(6, DIMS)
    rows[2]["id"] = "r-\x00-2"
    return rows


def test_the_vector_fast_path_refers_a_nul_id(tmp_path: Path, capsys) -> None:
    """Records of vectors only are parsed by msgspec, which keeps a NUL."""
    path = write_jsonl(tmp_path / "r.jsonl", vector_rows())
    root = tmp_path / "root"
    assert index_build(make_model_dir(tmp_path / "m"), path, root, "--skip-bad") == 0
    assert f"rejected line 3, id 'r-\\x00-2': 'id' {NUL}" in capsys.readouterr().out
    assert artifact.read_manifest(artifact.current_version_dir(root))["counts"]["records"] == 5


def test_the_parquet_path_refers_a_nul_id(tmp_path: Path, capsys) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = vector_rows()
    table = pa.table({k: [r[k] for r in rows] for k in ("id", *DIMS)})
    pq.write_table(table, tmp_path / "r.parquet")
    root = tmp_path / "root"
    assert index_build(make_model_dir(tmp_path / "m"), tmp_path / "r.parquet", root) == 2
    assert f"r.parquet, line 3, id 'r-\\x00-2': 'id' {NUL}" in capsys.readouterr().err


def test_training_refuses_a_lone_surrogate_id(vector_config: Path, tmp_path: Path, capsys) -> None:
    rows = vector_records(64, DIMS)
    rows[4]["id"] = "r-\ud800"
    write_jsonl(tmp_path / "train.jsonl", rows)
    argv = ["train", "--config", str(vector_config), "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"train.jsonl, line 5, id 'r-\\\\ud800': 'id' {SURROGATE}"), err
