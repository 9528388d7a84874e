"""A version is never served with a file that does not match its manifest: every file's checksum
is read before a version first serves on a machine (on versions whose files are all over the old
1 MiB limit of the quick check), remembered so that a restart does not read them again, and a
refused version is neither served, retried in a loop, nor listed once CURRENT moves on. Also
the copied-manifest case and `hclip index rollback`."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import app.services.versions as versions_module
from indexer.store import artifact
from tests.app.conftest import running, settings_for, wait_until
from tests.conftest import index_build, make_model_dir, run_cli, vector_records, write_jsonl

SMALL = 1 << 20  # the quick check's old limit: every file flipped below is larger
FLIPPED = ["views/a.npy", "embeddings/a.npy", "records/payloads.bin"]


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """A root with two versions of 40,000 records (payloads padded): every flipped file is over
    1 MiB."""
    tmp = tmp_path_factory.mktemp("large")
    model = make_model_dir(tmp / "model")
    rows = vector_records(40_000, {"a": 6, "b": 5, "c": 4}, seed=0, k=40)
    for i, r in enumerate(rows):
        r["payload"] = {"symbol": r["payload"]["symbol"], "note": f"record number {i:08d} " * 2}
    root = tmp / "root"
    made = []
    for n, part in enumerate((rows[:40_000], rows[:39_000])):
        write_jsonl(tmp / f"r{n}.jsonl", part)
        assert index_build(model, tmp / f"r{n}.jsonl", root) == 0
        made.append(artifact.read_current(root))
    vdir = artifact.version_dir(root, made[0])
    for rel in FLIPPED:
        assert (vdir / rel).stat().st_size > SMALL, rel
    return root, model, made


def copy_root(root: Path, to: Path, current: str) -> Path:
    shutil.copytree(root, to)
    artifact.write_current(to, current)
    return to


@pytest.mark.parametrize("rel", FLIPPED)
def test_a_cold_start_on_a_corrupt_version_is_not_ready(large, tmp_path, rel) -> None:
    root, _, (v1, _) = large
    root = copy_root(root, tmp_path / "root", v1)
    flip_byte(artifact.version_dir(root, v1) / rel)
    with running(settings_for(root), wait_ready=False) as client:
        r = client.get("/readyz")
        assert r.status_code == 503
        assert f"version {v1} cannot be served" in r.json()["error"], r.text
        assert f"{rel}: checksum mismatch" in r.json()["error"]
        assert client.post("/v1/search", json={"query": {"a": [0.1] * 6}}).status_code == 503
        info = client.get("/v1/info")
        assert info.status_code == 503


@pytest.mark.parametrize("rel", FLIPPED)
def test_a_corrupt_new_version_is_not_swapped_in(large, tmp_path, rel) -> None:
    root, _, (v1, v2) = large
    root = copy_root(root, tmp_path / "root", v1)
    flip_byte(artifact.version_dir(root, v2) / rel)
    with running(settings_for(root)) as client:
        query = {"query": {"a": [0.1] * 6}, "k": 10}
        before = client.post("/v1/search", json=query).json()
        artifact.write_current(root, v2)
        wait_until(lambda: client.get("/v1/info").json()["rejected_versions"] != [])
        info = client.get("/v1/info").json()
        assert info["index_version"] == v1
        refused = info["rejected_versions"][0]
        assert refused["version"] == v2 and refused["next_retry_in_s"] is None
        assert refused["reason"].endswith(f"{rel}: checksum mismatch")
        assert str(root) not in refused["reason"]
        after = client.post("/v1/search", json=query).json()
        assert after["results"] == before["results"] and after["index_version"] == v1
        time.sleep(1.0)  # ten polls: a refused version is not checked again in a loop
        assert client.get("/v1/info").json()["rejected_versions"][0]["attempts"] == 1
        # CURRENT back on the serving version: nothing is refused any more
        artifact.write_current(root, v1)
        wait_until(lambda: client.get("/v1/info").json()["rejected_versions"] == [])


def test_a_checked_version_is_not_checked_again(large, tmp_path, monkeypatch) -> None:
    root, _, (v1, _) = large
    root = copy_root(root, tmp_path / "root", v1)
    checked = tmp_path / "checked"
    reads: list[Path] = []
    verify_files = versions_module.verify_files

    def counted(vdir: Path, full: bool = True) -> list[str]:
        reads.append(vdir)
        return verify_files(vdir, full)

    monkeypatch.setattr(versions_module, "verify_files", counted)
    with running(settings_for(root, checked_dir=checked)) as client:
        assert client.get("/readyz").status_code == 200
    assert len(reads) == 1
    with running(settings_for(root, checked_dir=checked)) as client:  # a restart
        assert client.get("/readyz").status_code == 200
    assert len(reads) == 1
    flip_byte(artifact.version_dir(root, v1) / "views/a.npy")  # a file changes: checked again
    with running(settings_for(root, checked_dir=checked), wait_ready=False) as client:
        assert "views/a.npy: checksum mismatch" in client.get("/readyz").json()["error"]
    assert len(reads) == 2


def test_a_copy_under_another_name_is_refused(large, tmp_path, capsys) -> None:
    root, _, (v1, _) = large
    root = copy_root(root, tmp_path / "root", v1)
    copy = "20991231T000000000000Z-c0ffee"
    shutil.copytree(artifact.version_dir(root, v1), artifact.version_dir(root, copy))
    assert run_cli("index", "verify", "--root", root, "--version", copy) != 0
    assert f"names version '{v1}'" in capsys.readouterr().out
    with running(settings_for(root)) as client:
        artifact.write_current(root, copy)
        wait_until(lambda: client.get("/v1/info").json()["rejected_versions"] != [])
        info = client.get("/v1/info").json()
        assert info["index_version"] == v1
        assert f"names version '{v1}'" in info["rejected_versions"][0]["reason"]
        time.sleep(0.5)
        assert client.get("/v1/info").json()["rejected_versions"][0]["attempts"] == 1


def test_rollback(large, tmp_path, capsys) -> None:
    root, _, (v1, v2) = large
    root = copy_root(root, tmp_path / "root", v2)
    assert run_cli("index", "rollback", "--root", root) == 0
    assert artifact.read_current(root) == v1
    assert f"published version {v1} again (was {v2})" in capsys.readouterr().out
    assert run_cli("index", "rollback", "--root", root) == 2  # nothing older than v1
    assert "no version older than the published one" in capsys.readouterr().err
    assert run_cli("index", "rollback", "--root", root, "--to", v2) == 0
    assert artifact.read_current(root) == v2
    assert run_cli("index", "rollback", "--root", root, "--to", "nosuch") == 2
    assert "no version 'nosuch'" in capsys.readouterr().err
    flip_byte(artifact.version_dir(root, v1) / "embeddings/a.npy")  # never to a corrupt one
    assert run_cli("index", "rollback", "--root", root) == 2
    assert "embeddings/a.npy: checksum mismatch" in capsys.readouterr().err
    assert artifact.read_current(root) == v2
