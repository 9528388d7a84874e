"""Incremental updates: equal to a full rebuild, re-encoding only what changed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from indexer.store import artifact
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from models.model import MultimodalModel
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl


@pytest.fixture
def encoded_items(monkeypatch) -> list[int]:
    """Counts the inputs that go through any encoder, as rows or as a stacked batch."""
    calls: list[int] = []
    encode, encode_batch = MultimodalModel.encode, MultimodalModel.encode_batch

    def counting(self, modality, items):
        calls.append(len(items))
        return encode(self, modality, items)

    def counting_batch(self, modality, batch):
        calls.append(len(batch))
        return encode_batch(self, modality, batch)

    monkeypatch.setattr(MultimodalModel, "encode", counting)
    monkeypatch.setattr(MultimodalModel, "encode_batch", counting_batch)
    return calls


def by_id(version: LoadedVersion) -> dict[str, dict[str, np.ndarray]]:
    return {
        r["id"]: {n: np.asarray(version.stored.embeddings[n][i]) for n in r["modalities"]}
        for i, r in enumerate(version.records)
    }


def test_update_equals_full_rebuild_and_encodes_only_upserts(tmp_path: Path, encoded_items) -> None:
    base = vector_records(300, DIMS, seed=0, k=40)
    changed = vector_records(40, DIMS, seed=7, k=40)  # ids r-00000..r-00039: replacements
    for r in changed[:10]:
        r.pop("b")
    new = [dict(r, id=f"new-{i}") for i, r in enumerate(vector_records(25, DIMS, seed=8, k=40))]
    deleted = [f"r-{i:05d}" for i in range(100, 130)] + ["never-existed"]
    write_jsonl(tmp_path / "base.jsonl", base)
    write_jsonl(tmp_path / "upsert.jsonl", changed + new)
    (tmp_path / "delete.txt").write_text("\n".join(deleted) + "\n")
    model_dir = make_model_dir(tmp_path / "m")
    root, full = tmp_path / "root", tmp_path / "full"

    assert index_build(model_dir, tmp_path / "base.jsonl", root) == 0
    first = artifact.read_current(root)
    encoded_items.clear()
    assert (
        run_cli(
            "index",
            "update",
            "--root",
            root,
            "--upsert",
            tmp_path / "upsert.jsonl",
            "--delete",
            tmp_path / "delete.txt",
            "--quiet",
        )
        == 0
    )
    # only the 65 upserted records went through the encoders, modality by modality
    assert sum(encoded_items) == 65 * 3 - 10

    gone = set(deleted)
    replaced = {r["id"] for r in changed}
    final = [r for r in base if r["id"] not in gone and r["id"] not in replaced] + changed + new
    write_jsonl(tmp_path / "final.jsonl", final)
    assert index_build(model_dir, tmp_path / "final.jsonl", full) == 0

    upd = LoadedVersion(artifact.current_version_dir(root))
    ref = LoadedVersion(artifact.current_version_dir(full))
    assert upd.manifest["parent"] == first
    assert upd.manifest["update"]["deleted_not_found"] == ["never-existed"]
    a, b = by_id(upd), by_id(ref)
    assert a.keys() == b.keys() and not (a.keys() & gone)
    for rid in a:
        assert a[rid].keys() == b[rid].keys()
        for n in a[rid]:
            assert np.allclose(a[rid][n], b[rid][n], atol=1e-6), (rid, n)
    xq = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    for name in ref.views:
        s1, r1 = upd.views[name].search(xq, 10)
        s2, r2 = ref.views[name].search(xq, 10)
        ids1 = [[upd.records[i]["id"] for i in row] for row in r1]
        ids2 = [[ref.records[i]["id"] for i in row] for row in r2]
        assert ids1 == ids2 and np.allclose(s1, s2, atol=1e-5)
        assert not {i for row in ids1 for i in row} & gone
    assert verify(upd.path) == []


def test_update_refuses_a_different_model(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "r.jsonl", vector_records(50, DIMS))
    m1 = make_model_dir(tmp_path / "m1", seed=0)
    m2 = make_model_dir(tmp_path / "m2", seed=1)
    root = tmp_path / "root"
    assert index_build(m1, tmp_path / "r.jsonl", root) == 0
    before = artifact.read_current(root)
    assert (
        run_cli(
            "index",
            "update",
            "--root",
            root,
            "--model",
            m2,
            "--upsert",
            tmp_path / "r.jsonl",
            "--quiet",
        )
        == 2
    )
    assert "differs from the one that built" in capsys.readouterr().err
    assert artifact.read_current(root) == before
    assert len(artifact.list_versions(root)) == 1


def test_update_without_a_published_version(tmp_path: Path, capsys) -> None:
    (tmp_path / "d.txt").write_text("x\n")
    assert (
        run_cli("index", "update", "--root", tmp_path / "root", "--delete", tmp_path / "d.txt") == 2
    )
    assert "no published version" in capsys.readouterr().err


def test_an_invalid_upsert_of_an_existing_id_keeps_the_old_record(tmp_path: Path, capsys) -> None:
    base = vector_records(30, DIMS, seed=0)
    write_jsonl(tmp_path / "base.jsonl", base)
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert index_build(model_dir, tmp_path / "base.jsonl", root) == 0
    old = LoadedVersion(artifact.current_version_dir(root))
    kept_emb = {n: np.asarray(old.stored.embeddings[n][5]) for n in ("a", "b", "c")}
    bad = dict(base[5], a=[1.0, 2.0])  # wrong length: invalid
    good = dict(base[6], payload={"replaced": True})
    lines = [json.dumps(bad), json.dumps(good), "{not json", json.dumps(dict(base[7], b="x"))]
    (tmp_path / "up.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "del.txt").write_text("r-00009\n")
    first = artifact.read_current(root)

    # Without --skip-bad: nothing is published.
    args = ["index", "update", "--root", root, "--upsert", tmp_path / "up.jsonl", "--quiet"]
    assert run_cli(*args, "--delete", tmp_path / "del.txt") == 2
    assert "line 1, id 'r-00005': a: vector must have length 6, got 2" in capsys.readouterr().err
    assert artifact.read_current(root) == first

    # With it: the invalid upserts are left out and their ids keep their old records.
    assert run_cli(*args, "--delete", tmp_path / "del.txt", "--skip-bad") == 0
    out = capsys.readouterr().out
    assert "rejected line 1, id 'r-00005': a: vector must have length 6" in out
    assert "rejected line 3: not valid JSON" in out
    assert "rejected line 4, id 'r-00007': b: vector must be a list of numbers" in out
    new = LoadedVersion(artifact.current_version_dir(root))
    ids = [r["id"] for r in new.records]
    assert len(ids) == 29 and "r-00009" not in ids and {"r-00005", "r-00007"} <= set(ids)
    row = new.records.row_of("r-00005")
    assert row is not None and new.records[row]["payload"] == base[5]["payload"]
    for n, e in kept_emb.items():
        assert np.array_equal(np.asarray(new.stored.embeddings[n][row]), e)
    replaced = new.records.row_of("r-00006")
    assert replaced is not None and new.records[replaced]["payload"] == {"replaced": True}
    m = new.manifest
    assert m["counts"]["records"] == 29 and m["counts"]["rejected"] == 3
    assert m["update"] == {
        "kept": 28,
        "encoded": 1,
        "replaced": 1,
        "deleted": 1,
        "deleted_not_found": [],
    }
    assert [r["line"] for r in m["rejected"]] == [1, 3, 4]
    assert verify(new.path) == []


def test_an_upsert_keeps_each_filter_column_s_type(tmp_path: Path, capsys) -> None:
    """A numeric column stays numeric (a value that is not a number is a bad record, named),
    and a categorical one stays categorical even when the upserts hold only numbers."""
    base = [dict(r, payload={"year": 2015 + i % 10, "lang": "en"})
            for i, r in enumerate(vector_records(40, DIMS, seed=0))]  # fmt: skip
    write_jsonl(tmp_path / "base.jsonl", base)
    model_dir = make_model_dir(tmp_path / "m")
    root = tmp_path / "root"
    assert (
        index_build(model_dir, tmp_path / "base.jsonl", root, "--filter-fields", "year,lang") == 0
    )
    first = artifact.read_current(root)
    up = [dict(base[0], id="new-0", payload={"year": 2030, "lang": 7}),
          dict(base[1], id="new-1", payload={"year": "MMXX", "lang": "de"})]  # fmt: skip
    write_jsonl(tmp_path / "up.jsonl", up)
    args = ["index", "update", "--root", root, "--upsert", tmp_path / "up.jsonl", "--quiet"]

    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert "up.jsonl, line 2, id 'new-1': payload.year: \"MMXX\" does not fit" in err, err
    assert "'year' is a numeric filter field" in err
    assert artifact.read_current(root) == first

    assert run_cli(*args, "--skip-bad") == 0
    assert "rejected line 2, id 'new-1': payload.year" in capsys.readouterr().out
    new = LoadedVersion(artifact.current_version_dir(root))
    assert new.manifest["filter_fields"]["year"]["type"] == "numeric"
    assert new.manifest["filter_fields"]["lang"]["type"] == "categorical"
    view = next(iter(new.views.values()))
    recent = new.mask_of(view, {"year": {"gte": 2030}})  # a range still works on the column
    assert [new.records[int(p)]["id"] for p in np.flatnonzero(recent)] == ["new-0"]


def test_an_update_that_changes_nothing_publishes_nothing(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "base.jsonl", vector_records(20, DIMS, seed=0))
    root = tmp_path / "root"
    assert index_build(make_model_dir(tmp_path / "m"), tmp_path / "base.jsonl", root) == 0
    before = artifact.list_versions(root)
    (tmp_path / "gone.txt").write_text("never-there\nnor-this\n")
    assert run_cli("index", "update", "--root", root, "--delete", tmp_path / "gone.txt") == 0
    assert "nothing to change" in capsys.readouterr().out
    assert artifact.list_versions(root) == before
    assert list((root / artifact.STAGING).iterdir()) == []  # no half-made version left
