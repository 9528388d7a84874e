"""A build killed with SIGKILL leaves the published version alone; list, verify and gc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from indexer.store import artifact
from indexer.store import verify as verify_module
from indexer.store.verify import verify, verify_contents
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stage_reached", ["encoding", "views"])
def test_sigkill_during_build_leaves_previous_version_published(
    tmp_path: Path, stage_reached: str
) -> None:
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "small.jsonl", vector_records(50, DIMS))
    write_jsonl(tmp_path / "big.jsonl", vector_records(30000, DIMS, seed=1))
    root = tmp_path / "root"
    assert index_build(model, tmp_path / "small.jsonl", root) == 0
    published = artifact.read_current(root)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "index",
            "build",
            "--model",
            str(model),
            "--records",
            str(tmp_path / "big.jsonl"),
            "--root",
            str(root),
            "--quiet",
            "--batch-size",
            "64",
            "--spec",
            "hnsw:M=8,ef_construction=40",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    target = "embeddings/a.npy" if stage_reached == "encoding" else "views/a.rows.npy"
    staged: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        staged = list((root / artifact.STAGING).glob(f"*/{target}"))
        if staged and staged[0].stat().st_size > 0:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the build finished before it could be killed; grow the input"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert staged, "never saw the staged files"
    # the dead build left its staging directory, and nothing else changed
    assert artifact.read_current(root) == published
    assert [v["version"] for v in artifact.list_versions(root)] == [published]
    assert verify(artifact.version_dir(root, published)) == []
    assert run_cli("index", "verify", "--root", root) == 0
    # the next run cleans up what the dead one left, then publishes
    assert index_build(model, tmp_path / "small.jsonl", root) == 0
    assert list((root / artifact.STAGING).iterdir()) == []
    assert artifact.read_current(root) != published


def test_verify_detects_tampering(tmp_path: Path, capsys) -> None:
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", vector_records(80, DIMS))
    root = tmp_path / "root"
    assert index_build(model, tmp_path / "r.jsonl", root) == 0
    vdir = artifact.current_version_dir(root)
    faiss_file = vdir / "views" / "a.npy"
    data = bytearray(faiss_file.read_bytes())
    data[-3] ^= 0xFF
    faiss_file.write_bytes(bytes(data))
    assert run_cli("index", "verify", "--root", root) == 1
    assert "views/a.npy: checksum mismatch" in capsys.readouterr().out
    (vdir / "stray.txt").write_text("x")
    faiss_file.unlink()
    assert run_cli("index", "verify", "--root", root) == 1
    out = capsys.readouterr().out
    assert "views/a.npy: missing" in out and "stray.txt: not listed" in out


def test_list_and_gc_never_remove_the_published_version(tmp_path: Path, capsys) -> None:
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", vector_records(30, DIMS))
    root = tmp_path / "root"
    for _ in range(4):
        assert index_build(model, tmp_path / "r.jsonl", root) == 0
    versions = [v["version"] for v in artifact.list_versions(root)]
    assert versions == sorted(versions) and len(versions) == 4
    # publish an older version again (a rollback): gc must keep it
    artifact.write_current(root, versions[0])
    assert run_cli("index", "gc", "--root", root, "--keep", "2") == 0
    left = [v["version"] for v in artifact.list_versions(root)]
    assert left == [versions[0], versions[2], versions[3]]
    assert run_cli("index", "list", "--root", root) == 0
    out = capsys.readouterr().out
    assert f"* {versions[0]}" in out
    assert run_cli("index", "gc", "--root", root, "--keep", "0") == 2


def test_a_second_writer_is_refused_while_one_holds_the_lock(tmp_path: Path, capsys) -> None:
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", vector_records(30, DIMS))
    root = tmp_path / "root"
    with artifact.root_lock(root, "build"):
        assert index_build(model, tmp_path / "r.jsonl", root) == 2
    assert "another build, update or gc is running" in capsys.readouterr().err


def test_the_full_check_recomputes_every_view_across_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Views over different rows (records lacking a modality), checked 16 record rows at a
    time: a changed vector is named with its view and the first position of its chunk, and
    the other views stay clean."""
    records = vector_records(120, DIMS)
    for i, r in enumerate(records):
        if i % 3 == 0:
            del r["c"]
        if i % 5 == 0:
            del r["a"]
    write_jsonl(tmp_path / "r.jsonl", records)
    root = tmp_path / "root"
    assert index_build(make_model_dir(tmp_path / "m"), tmp_path / "r.jsonl", root) == 0
    vdir = artifact.current_version_dir(root)
    monkeypatch.setattr(verify_module, "CHUNK", 16)
    assert verify_contents(vdir) == []
    rows = np.load(vdir / "views" / "b+c.rows.npy")
    assert 0 < len(rows) < 120
    vectors = np.load(vdir / "views" / "b+c.npy", mmap_mode="r+")
    vectors[40] += 0.5
    vectors.flush()
    del vectors
    chunk_start = int(rows[40]) // 16 * 16
    first = int(np.searchsorted(rows, chunk_start))
    assert verify_contents(vdir) == [f"view b+c: vectors at positions {first}.. differ"]
    np.save(vdir / "views" / "a+c.rows.npy", np.load(vdir / "views" / "a+c.rows.npy")[1:])
    problems = verify_contents(vdir)
    assert "view a+c: rows differ from the records that have ('b',)" in problems  # its target
    assert len(problems) == 2


def test_rollback_and_gc_follow_the_order_of_publication_not_the_clock(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Three builds, the clock stepped back an hour before the second and again before the
    third: their ids sort v2 < v3 < v1, but rollback goes to the parent each time and gc keeps
    the last published."""
    import types

    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", vector_records(30, DIMS))
    root = tmp_path / "root"
    published = []
    for now in (2_000_000_000.0, 1_999_996_400.0, 1_999_998_000.0):
        clock = types.SimpleNamespace(time=lambda now=now: now, gmtime=time.gmtime,
                                      strftime=time.strftime)  # fmt: skip
        monkeypatch.setattr(artifact, "time", clock)  # the ids' timestamp source
        assert index_build(model, tmp_path / "r.jsonl", root) == 0
        published.append(artifact.read_current(root))
    v1, v2, v3 = published
    assert sorted(published) == [v2, v3, v1]  # the clock's order
    assert [r["version"] for r in artifact.list_versions(root)] == [v1, v2, v3]
    assert run_cli("index", "rollback", "--root", root) == 0
    assert artifact.read_current(root) == v2
    assert run_cli("index", "rollback", "--root", root) == 0
    assert artifact.read_current(root) == v1
    assert run_cli("index", "rollback", "--root", root) == 2
    assert "no version older than the published one" in capsys.readouterr().err
    artifact.write_current(root, v3)
    assert run_cli("index", "gc", "--root", root, "--keep", "2") == 0
    assert [r["version"] for r in artifact.list_versions(root)] == [v2, v3]


def test_current_naming_a_path_outside_the_root_is_refused_everywhere(
    tmp_path: Path, capsys
) -> None:
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", vector_records(30, DIMS))
    other, root = tmp_path / "otherroot", tmp_path / "root"
    assert index_build(model, tmp_path / "r.jsonl", other) == 0
    assert index_build(model, tmp_path / "r.jsonl", root) == 0
    mine = artifact.read_current(root)
    outside = f"../../otherroot/versions/{artifact.read_current(other)}"
    artifact.write_current(root, outside)
    capsys.readouterr()
    assert run_cli("index", "verify", "--root", root) == 1
    out = capsys.readouterr().out
    assert f"{root / 'CURRENT'} names {outside!r}, which is not a version name" in out, out
    for argv in (("gc", "--keep", "1"), ("rollback",)):
        assert run_cli("index", *argv[:1], "--root", root, *argv[1:]) == 2
        err = capsys.readouterr().err.strip()
        assert f"hclip index {argv[0]}: error: {root / 'CURRENT'} names {outside!r}" in err, err
    assert len(list((root / "versions").iterdir())) == 1  # gc removed nothing
    assert run_cli("index", "rollback", "--root", root, "--to", mine) == 0  # mends it
    assert artifact.published(root) == mine
    assert run_cli("index", "verify", "--root", root) == 0
