"""A records file's media paths stay inside its media root (the records file's folder, or
--media-root): `..`, absolute paths and symlinks out of it, directories, FIFOs and devices are
bad records naming the line, the id and the field, and --skip-bad leaves them out. The files
outside are real PNGs, so reading them would have succeeded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from indexer.store import artifact
from tests.conftest import index_build, run_cli, write_jsonl
from tests.models.test_inputs import png_bytes

REPO = Path(__file__).resolve().parents[2]
MODS = {
    "image": {"kind": "image", "image_size": 8, "hidden": 8},
    "vec": {"kind": "vector", "dim": 3},
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    cfg = ModelConfig.from_dict({"modalities": MODS, "latent_dim": 4})
    return save_model(MultimodalModel(cfg), tmp_path / "model")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp/recs/pics/{0..3}.png beside the records, and tmp/outside/secret.png out of them."""
    (tmp_path / "recs/pics").mkdir(parents=True)
    for i in range(4):
        (tmp_path / f"recs/pics/{i}.png").write_bytes(png_bytes())
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret.png").write_bytes(png_bytes())
    return tmp_path


def records(tree: Path, image: str, name: str = "r.jsonl") -> Path:
    """Four records; the third's image is `image`."""
    rows = [{"id": f"g{i}", "image": f"pics/{i}.png", "vec": [i, 1.0, 2.0]} for i in range(4)]
    rows[2]["image"] = image
    return write_jsonl(tree / "recs" / name, rows)


def link(at: Path, target: Path) -> str:
    at.symlink_to(target)
    return str(at.relative_to(at.parents[1]))  # as the records file names it


# (what the third record's image is, given the tree; what the bad record's message says)
OUT_OF_ROOT = [
    ("dotdot", lambda t: "../outside/secret.png", "is outside the media root"),
    ("dotdot inside", lambda t: "pics/../../outside/secret.png", "is outside the media root"),
    ("absolute", lambda t: str(t / "outside/secret.png"), "is outside the media root"),
    (
        "symlink to a file",
        lambda t: link(t / "recs/pics/x.png", t / "outside/secret.png"),
        "is outside the media root",
    ),
    (
        "symlink to a folder",
        lambda t: link(t / "recs/pics/out", t / "outside") + "/secret.png",
        "is outside the media root",
    ),
    ("a directory", lambda t: "pics", "is not a regular file (a directory)"),
    ("/etc/passwd", lambda t: "/etc/passwd", "is outside the media root"),
]


@pytest.mark.parametrize(("name", "image", "message"), OUT_OF_ROOT, ids=[c[0] for c in OUT_OF_ROOT])
def test_a_path_out_of_the_root_fails_the_build(
    tree: Path, model: Path, capsys, name, image, message: str
) -> None:
    path = records(tree, image(tree))
    root = tree / "root"
    assert index_build(model, path, root) == 2
    err = capsys.readouterr().err
    assert "r.jsonl, line 3, id 'g2': image: image file " in err and message in err, err
    assert artifact.read_current(root) is None


@pytest.mark.parametrize(("name", "image", "message"), OUT_OF_ROOT, ids=[c[0] for c in OUT_OF_ROOT])
def test_skip_bad_leaves_a_path_out_of_the_root_out(
    tree: Path, model: Path, capsys, name, image, message: str
) -> None:
    path = records(tree, image(tree))
    root = tree / "root"
    assert index_build(model, path, root, "--skip-bad") == 0
    out = capsys.readouterr().out
    assert "rejected line 3, id 'g2': image: image file " in out and message in out, out
    m = artifact.read_manifest(artifact.current_version_dir(root))
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1


def test_paths_inside_the_root_are_read_however_they_are_written(tree: Path, model: Path) -> None:
    """An absolute path into the folder, a `..` that stays in it, a symlink within it."""
    link(tree / "recs/pics/alias.png", tree / "recs/pics/1.png")
    rows = [
        {"id": "abs", "image": str(tree / "recs/pics/0.png"), "vec": [0, 1, 2]},
        {"id": "dotdot", "image": "pics/../pics/1.png", "vec": [1, 1, 2]},
        {"id": "link", "image": "pics/alias.png", "vec": [2, 1, 2]},
    ]
    path = write_jsonl(tree / "recs/r.jsonl", rows)
    assert index_build(model, path, tree / "root") == 0
    m = artifact.read_manifest(artifact.current_version_dir(tree / "root"))
    assert m["counts"]["records"] == 3


def test_media_root_widens_the_root_for_build_and_update(tree: Path, model: Path) -> None:
    path = records(tree, "../outside/secret.png")
    root = tree / "root"
    assert index_build(model, path, root, "--media-root", tree) == 0
    assert artifact.read_manifest(artifact.current_version_dir(root))["counts"]["records"] == 4
    upsert = write_jsonl(
        tree / "recs/u.jsonl", [{"id": "g9", "image": "../outside/secret.png", "vec": [9, 1, 2]}]
    )
    argv = ["index", "update", "--root", root, "--upsert", upsert, "--quiet"]
    assert run_cli(*argv) == 2  # the records file's folder alone does not hold it
    assert run_cli(*argv, "--media-root", tree) == 0
    assert artifact.read_manifest(artifact.current_version_dir(root))["counts"]["records"] == 5


def test_a_media_root_that_is_no_directory_is_one_line(tree: Path, model: Path, capsys) -> None:
    path = records(tree, "pics/2.png")
    assert index_build(model, path, tree / "root", "--media-root", tree / "nope") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hclip index build: error: --media-root {tree / 'nope'}: not a directory"]


HEAP_CAP = 3 << 30  # bytes of data segment the limited child may take


def hclip_limited(*argv: object) -> subprocess.CompletedProcess[str]:
    """`hclip` in a process of its own, with a deadline and a heap cap: a regression that
    blocks on a FIFO or reads /dev/zero fails the test instead of hanging the suite or
    taking the machine's memory. The child sets the cap itself, before it loads anything:
    a `preexec_fn` runs between fork and exec, which is not safe in a process with threads
    (this one has gRPC's once the Ray tests ran, and a child started that way once died of
    gRPC's abort on its poller's closed descriptor)."""
    code = (
        "import resource, runpy; "
        f"resource.setrlimit(resource.RLIMIT_DATA, ({HEAP_CAP}, {HEAP_CAP})); "
        "runpy.run_module('app.cli', run_name='__main__', alter_sys=True)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, argv)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def build_argv(model: Path, records: Path, root: Path) -> list[object]:
    return ["index", "build", "--model", model, "--records", records, "--root", root, "--quiet"]


def test_a_fifo_is_a_bad_record_and_never_blocks(tree: Path, model: Path) -> None:
    """A FIFO hung the job (while it held the root's lock) in the open that waits for a
    writer."""
    os.mkfifo(tree / "recs/pics/fifo.png")
    path = records(tree, "pics/fifo.png")
    done = hclip_limited(*build_argv(model, path, tree / "root"), "--skip-bad")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rejected line 3, id 'g2': image: image file " in done.stdout
    assert "pics/fifo.png is not a regular file (a FIFO)" in done.stdout
    m = artifact.read_manifest(artifact.current_version_dir(tree / "root"))
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "image file /dev/zero is outside the media root"),
        (["--media-root", "/"], "image file /dev/zero is not a regular file (a device)"),
    ],
)
def test_dev_zero_is_never_read(tree: Path, model: Path, extra: list[str], message: str) -> None:
    """/dev/zero was read until memory ran out; with a root that holds /dev, its type is
    refused."""
    path = records(tree, "/dev/zero")
    done = hclip_limited(*build_argv(model, path, tree / "root"), "--skip-bad", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"rejected line 3, id 'g2': image: {message}" in done.stdout
    m = artifact.read_manifest(artifact.current_version_dir(tree / "root"))
    assert m["counts"]["records"] == 3 and m["counts"]["rejected"] == 1


def test_training_reads_media_only_inside_its_media_root(tree: Path, capsys) -> None:
    """`hclip train` decodes media when it reads a batch; train.media_root widens the root."""
    from app.cli import main

    rows = [{"id": f"g{i}", "image": f"pics/{i % 4}.png", "vec": [i, 1, 2]} for i in range(8)]
    rows[5]["image"] = "../outside/secret.png"
    write_jsonl(tree / "recs/train.jsonl", rows)
    train = {"records": "recs/train.jsonl", "epochs": 1, "batch_size": 4}
    config = {"modalities": MODS, "head": "hclip", "latent_dim": 4, "train": train}
    (tree / "config.json").write_text(json.dumps(config))
    argv = ["train", "--config", str(tree / "config.json"), "--out", str(tree / "m"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "line 6, id 'g5': image: image file " in err and "outside the media root" in err, err
    train["media_root"] = "."  # relative to the config, like train.records: all of the tree
    (tree / "config.json").write_text(json.dumps(config))
    assert main([*argv, "--overwrite"]) == 0
