"""The memory-mapped record store: lookups, payloads and presence equal a plain-Python reference
(the previous implementation parsed every record into a dict); damage is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from indexer import artifact, recordstore
from indexer.reader import LoadedVersion
from indexer.recordstore import RecordStore, RecordStoreWriter
from indexer.verify import verify
from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl


def reference_records(path: Path, names: list[str]) -> list[dict]:
    """What the previous reader held in memory: one dict per line of the source, in order."""
    out = []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        out.append(
            {
                "id": obj["id"],
                "payload": obj.get("payload", {}),
                "modalities": sorted(n for n in names if obj.get(n) is not None),
            }
        )
    return out


def odd_records(n: int = 200) -> list[dict]:
    rows = vector_records(n, DIMS, seed=3, k=10)
    for i, r in enumerate(rows):
        r["id"] = ["r-", "émoji-☃-", "x" * 300 + "-", "tab\t", '"q"'][i % 5] + str(i)
        r["payload"] = [{}, {"nested": {"a": [1, 2.5, None, True]}}, {"s": "ünï"}][i % 3]
        if i % 7 == 0:
            r.pop("b")
    return rows


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("store")
    rows = odd_records()
    write_jsonl(tmp / "r.jsonl", rows)
    model = make_model_dir(tmp / "m")
    assert index_build(model, tmp / "r.jsonl", tmp / "root") == 0
    return tmp / "root", tmp / "r.jsonl", rows


def test_store_equals_the_reference(built) -> None:
    root, source, _ = built
    version = LoadedVersion(artifact.current_version_dir(root))
    ref = reference_records(source, version.names)
    assert list(version.records) == ref
    for row, rec in enumerate(ref):
        assert version.records.row_of(rec["id"]) == row
        assert orjson.loads(version.records.payload_json(row)) == rec["payload"]
    assert version.records.row_of("no-such-id") is None
    assert version.records.row_of("") is None
    assert version.records.problems() == []


def test_hash_collisions_cost_a_comparison_not_a_wrong_answer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(recordstore, "id_hash", lambda rid: len(rid) % 3)  # collide a lot
    names = ["a", "b"]
    w = RecordStoreWriter(tmp_path, names)
    ids = [f"id{i}" for i in range(50)] + ["", "x", "yy"]
    w.append(ids, [b"{}"] * len(ids), np.ones((len(ids), 2), bool))
    w.close()
    store = RecordStore(tmp_path, names)
    assert [store.row_of(i) for i in ids] == list(range(len(ids)))
    assert store.row_of("zz") is None and store.problems() == []


def test_an_empty_store(tmp_path: Path) -> None:
    w = RecordStoreWriter(tmp_path, ["a"])
    w.close()
    store = RecordStore(tmp_path, ["a"])
    assert len(store) == 0 and store.row_of("a") is None and list(store) == []


def copy_version(root: Path, tmp: Path) -> Path:
    import shutil

    src = artifact.current_version_dir(root)
    dst = tmp / "copy" / src.name
    shutil.copytree(src, dst)
    return dst


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-7]),
    # same size, the last byte changed: data, not a header
    "tampered": lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])),
}
STORE_FILES = ["payloads.bin", "ids.bin", "id_hash.npy", "presence.npy", "ids.offsets.npy"]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("name", STORE_FILES)
def test_verify_refuses_a_damaged_store(built, tmp_path: Path, damage: str, name: str) -> None:
    root, _, _ = built
    vdir = copy_version(root, tmp_path)
    target = vdir / "records" / name
    DAMAGE[damage](target)
    problems = verify(vdir)
    assert problems and any(name in p for p in problems), problems
