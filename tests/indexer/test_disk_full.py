"""A disk that fills up mid-build ends the command with one line naming what it was doing, the
path and the free space; nothing is published, nothing is left in staging, and every version
still verifies. On a real (small) filesystem: a tmpfs mounted for the test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.store import artifact
from indexer.store.verify import verify
from tests.conftest import DIMS, make_model_dir, vector_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:  # CI runs as root; elsewhere mounting may be refused
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def hclip(*argv: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *map(str, argv)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_disk_full_is_one_line_and_publishes_nothing(tmp_path: Path, small_fs: Path) -> None:
    model = make_model_dir(tmp_path / "model")
    root = small_fs / "root"
    write_jsonl(tmp_path / "small.jsonl", vector_records(200, DIMS, seed=0))
    write_jsonl(tmp_path / "large.jsonl", vector_records(30_000, DIMS, seed=1))
    ok = hclip("index", "build", "--model", model, "--records", tmp_path / "small.jsonl",
               "--root", root, "--quiet")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    first = artifact.read_current(root)

    full = hclip("index", "build", "--model", model, "--records", tmp_path / "large.jsonl",
                 "--root", root, "--quiet")  # fmt: skip
    assert full.returncode == 2, full.stderr
    assert "Traceback" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("hclip index build: error: writing version "), last
    assert f"under {root}; nothing was published" in last
    assert "No space left on device" in last or "the filesystem is full" in last, last
    assert "free of 2.0 MiB there" in last, last
    assert sum("error" in line for line in full.stderr.splitlines()) == 1, full.stderr

    assert artifact.read_current(root) == first
    assert list((root / artifact.STAGING).iterdir()) == []
    for v in artifact.list_versions(root):
        assert verify(artifact.version_dir(root, v["version"])) == [], v


def test_a_read_only_root_names_the_job_and_what_it_was_doing(
    tmp_path: Path, small_fs: Path
) -> None:
    model = make_model_dir(tmp_path / "model")
    root = small_fs / "root"
    write_jsonl(tmp_path / "small.jsonl", vector_records(50, DIMS, seed=0))
    build = ("index", "build", "--model", model, "--records", tmp_path / "small.jsonl",
             "--root", root, "--quiet")  # fmt: skip
    assert hclip(*build).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    for argv, job in ((build, "build"), (("index", "gc", "--root", root), "gc")):
        done = hclip(*argv)
        assert done.returncode == 2, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"hclip index {job}: error: {job}: taking the lock of the index "
                               f"root {root}: Read-only file system ({root}"), last  # fmt: skip
        assert "Traceback" not in done.stderr
