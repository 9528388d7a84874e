"""Format 3 of the artifact: BLAKE3 checksums, the store's id hash named in the manifest; and
format 2 versions (SHA-256, blake2b id hashes), still read, verified and updated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import numpy as np
import pytest

from indexer.store import artifact, recordstore
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl


def test_the_checksum_is_blake3_of_the_whole_file(tmp_path: Path) -> None:
    for size in (0, 1, 5000, (1 << 20) + 3):
        path = tmp_path / f"f{size}"
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        path.write_bytes(data)
        want = blake3.blake3(data).hexdigest()
        assert artifact.blake3_file(path) == want == artifact.blake3_file(path, threads=1)
        assert artifact.file_matches(path, {artifact.CHECKSUM: want, "bytes": size})
        assert not artifact.file_matches(path, {artifact.CHECKSUM: "0" * 64, "bytes": size})


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    rows = vector_records(300, DIMS, seed=0, k=40)
    for i, r in enumerate(rows):
        r["id"] = ["r-", "émoji-☃-", "x" * 30 + "-"][i % 3] + str(i)
    write_jsonl(tmp_path / "r.jsonl", rows)
    model = make_model_dir(tmp_path / "m")
    assert index_build(model, tmp_path / "r.jsonl", tmp_path / "root") == 0
    return tmp_path / "root", model, rows


def test_a_build_writes_format_3_with_every_checksum_right(built) -> None:
    root, _, rows = built
    vdir = artifact.current_version_dir(root)
    manifest = artifact.read_manifest(vdir)
    assert manifest["format_version"] == 3 and manifest["id_hash"] == "words64"
    files = manifest["files"]
    assert set(files) == set(artifact.list_files(vdir))
    for rel, meta in files.items():
        data = (vdir / rel).read_bytes()
        assert meta == {artifact.CHECKSUM: blake3.blake3(data).hexdigest(), "bytes": len(data)}
    version = LoadedVersion(vdir)
    assert [version.records.row_of(r["id"]) for r in rows] == list(range(len(rows)))
    assert verify(vdir) == []


def as_format_2(vdir: Path) -> None:
    """Rewrite a format 3 version as the previous hclip wrote it: blake2b id hashes, whole-file
    SHA-256 checksums, no id_hash in the manifest."""
    manifest = json.loads((vdir / artifact.MANIFEST).read_text())
    store = recordstore.RecordStore(vdir, manifest["modalities"])
    ids = [store.id_at(i) for i in range(len(store))]
    store.close()
    hashes = recordstore.id_hashes(ids, recordstore.LEGACY_ID_HASH_KIND)
    order = np.argsort(hashes, kind="stable")
    np.save(vdir / "records" / recordstore.ID_HASH, hashes[order])
    np.save(vdir / "records" / recordstore.ID_ROW, order.astype(np.int64))
    manifest["format_version"] = 2
    del manifest["id_hash"]
    manifest["files"] = {
        rel: {"sha256": artifact.sha256_file(vdir / rel), "bytes": (vdir / rel).stat().st_size}
        for rel in manifest["files"]
    }
    (vdir / artifact.MANIFEST).write_text(json.dumps(manifest))


def test_a_format_2_version_is_read_verified_and_updated(built, tmp_path: Path) -> None:
    root, _, rows = built
    vdir = artifact.current_version_dir(root)
    as_format_2(vdir)
    old = LoadedVersion(vdir)
    assert [old.records.row_of(r["id"]) for r in rows] == list(range(len(rows)))
    assert old.records.row_of("r-1") is None
    assert verify(vdir) == []

    emb = vdir / "embeddings" / "b.npy"
    saved = emb.read_bytes()
    emb.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    assert any("embeddings/b.npy: checksum mismatch" in p for p in verify(vdir))
    emb.write_bytes(saved)

    (tmp_path / "del.txt").write_text(rows[0]["id"] + "\n")
    assert run_cli("index", "update", "--root", root, "--delete", tmp_path / "del.txt") == 0
    new_dir = artifact.current_version_dir(root)
    assert new_dir != vdir and artifact.read_manifest(new_dir)["format_version"] == 3
    new = LoadedVersion(new_dir)
    assert new.records.row_of(rows[0]["id"]) is None
    assert [new.records.row_of(r["id"]) for r in rows[1:]] == list(range(len(rows) - 1))
    assert verify(new_dir) == []


def test_an_unknown_format_or_id_hash_is_refused(built) -> None:
    root, _, _ = built
    vdir = artifact.current_version_dir(root)
    manifest = json.loads((vdir / artifact.MANIFEST).read_text())
    (vdir / artifact.MANIFEST).write_text(json.dumps({**manifest, "id_hash": "md5"}))
    with pytest.raises(artifact.ArtifactError, match="unknown id hash 'md5'"):
        LoadedVersion(vdir)
    (vdir / artifact.MANIFEST).write_text(json.dumps({**manifest, "format_version": 4}))
    with pytest.raises(artifact.ArtifactError, match="reads formats 2, 3"):
        LoadedVersion(vdir)


def test_a_file_under_two_names_is_listed_twice_and_read_once(tmp_path: Path, monkeypatch):
    vdir = tmp_path / "v"
    vdir.mkdir()
    (vdir / "kept").write_bytes(b"abc")
    os.link(vdir / "kept", vdir / "linked")
    read: list[Path] = []
    blake3_file = artifact.blake3_file
    monkeypatch.setattr(artifact, "blake3_file", lambda p: read.append(p) or blake3_file(p))
    table = artifact.file_table(vdir)
    assert (
        table["kept"]
        == table["linked"]
        == {artifact.CHECKSUM: blake3.blake3(b"abc").hexdigest(), "bytes": 3}
    )
    assert len(read) == 1


def test_every_file_of_a_build_is_on_disk_before_current_names_it(tmp_path: Path, monkeypatch):
    # Writers only start writeback when they close a file (indexer.store.arrays): durability is the
    # publish's fsync of the whole staged version, and it must come before CURRENT moves.
    events: list[tuple[str, Path]] = []
    fsync_path, write_current = artifact.fsync_path, artifact.write_current
    monkeypatch.setattr(
        artifact, "fsync_path", lambda p: events.append(("fsync", p)) or fsync_path(p)
    )
    monkeypatch.setattr(
        artifact,
        "write_current",
        lambda root, v: events.append(("current", root)) or write_current(root, v),
    )
    write_jsonl(tmp_path / "r.jsonl", vector_records(50, DIMS, seed=1))
    model = make_model_dir(tmp_path / "m")
    assert index_build(model, tmp_path / "r.jsonl", tmp_path / "root") == 0
    vdir = artifact.current_version_dir(tmp_path / "root")
    kinds = [kind for kind, _ in events]
    assert kinds.count("current") == 1
    stage = tmp_path / "root" / artifact.STAGING / vdir.name  # where it was written
    synced = {
        p.relative_to(stage).as_posix()
        for kind, p in events[: kinds.index("current")]
        if kind == "fsync" and p.is_relative_to(stage)
    }
    assert set(artifact.list_files(vdir)) | {artifact.MANIFEST} <= synced


def test_a_staged_version_gaining_a_file_while_removed_is_removed(tmp_path: Path, monkeypatch):
    """A killed run's encoder (a Ray actor) can finish a shard in its staged version while the
    next run removes that version: the removal goes on until the version is gone."""
    staged = tmp_path / artifact.STAGING / "20261204T000000Z-dead"
    (staged / "shards").mkdir(parents=True)
    (staged / "shards" / "0.arrow").write_bytes(b"x")
    real_rmdir = os.rmdir
    late: list[Path] = []

    def rmdir_after_a_late_write(path, *args, **kwargs):
        if not late:  # the straggler's file lands between the listing and the rmdir
            late.append(staged / "shards" / "1.tmp")
            late[0].write_bytes(b"y")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_after_a_late_write)
    assert artifact.clean_staging(tmp_path) == [staged.name]
    assert late, "the late write never happened"
    assert list((tmp_path / artifact.STAGING).iterdir()) == []
