"""The memory-mapped record store: lookups, payloads and presence equal a plain-Python reference
(the previous implementation parsed every record into a dict); damage is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.store import artifact, recordstore
from indexer.store.recordstore import RecordStore, RecordStoreWriter, id_order
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
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
    def one(raw: bytes) -> int:
        return len(raw) % 3  # collide a lot

    def packed(blob: bytes, offsets: np.ndarray) -> np.ndarray:
        return (np.diff(offsets) % 3).astype(np.uint64)

    monkeypatch.setitem(recordstore.ID_HASHES, recordstore.ID_HASH_KIND, (one, packed))
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), max_size=30))
def test_the_id_hash_of_a_chunk_equals_the_hash_of_each_id(ids: list[str]) -> None:
    got = recordstore.id_hashes(ids)
    assert got.dtype == np.uint64 and got.tolist() == [recordstore.words64(i.encode()) for i in ids]


def test_the_id_hash_is_pinned() -> None:
    """Stored versions hash ids this way: a change must come with a new id_hash kind."""
    assert recordstore.words64(b"") == 0
    assert recordstore.words64(b"r0") == 0x2EC1E2DF09025FED
    assert recordstore.words64("émoji-☃-12345678".encode()) == 0x9757986E5D79C46D
    assert len({recordstore.words64(f"r{i}".encode()) for i in range(100_000)}) == 100_000


PAYLOAD_CASES = {
    "objects": ([b"{}", b'{"a":1}', b'{"b":[1,2]}'], None),
    "an array": ([b"{}", b"[1]", b"{}"], 1),
    "a number": ([b"{}", b"{}", b"7"], 2),
    "empty": ([b"{}", b"", b"{}"], 1),
    "not JSON": ([b'{"a":', b"{}"], 0),
    "two objects in one": ([b"{} {}", b"{}"], 0),
    "split across two": ([b'{"a":"', b'"}'], 0),
    "two that read as two objects across the break": ([b'{"a":', b"1}{}"], 0),
    "a space before": ([b"{}", b' {"a":1}'], None),
    "a newline inside an object": ([b'{"a":\n1}', b"{}"], None),
    "a newline between two": ([b"{}\n{}", b"{}"], 0),
}


@pytest.mark.parametrize("case", list(PAYLOAD_CASES))
def test_payload_check_names_the_first_that_is_not_an_object(case: str) -> None:
    payloads, first_bad = PAYLOAD_CASES[case]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in payloads])]).astype(np.int64)
    assert recordstore._not_objects(b"".join(payloads), offsets) == first_bad


def test_ids_are_ordered_by_hash_with_equal_hashes_in_row_order() -> None:
    hashes = np.array([5, 3, 5, 1, 3], dtype=np.uint64)
    assert id_order(hashes).tolist() == [3, 1, 4, 0, 2]  # as a stable sort orders them
    many = np.random.default_rng(0).integers(0, 2**63, 10_000).astype(np.uint64)
    assert np.array_equal(id_order(many), np.argsort(many, kind="stable"))
    tied = np.concatenate([many, many[::-1]])  # every hash twice
    assert np.array_equal(id_order(tied), np.argsort(tied, kind="stable"))
    assert id_order(np.zeros(0, np.uint64)).tolist() == []
