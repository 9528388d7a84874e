"""Where a pretrained tower's files are (its directory, the local Hugging Face cache or
$HCLIP_TOWERS_DIR), and the fingerprint of those files that a model's fingerprint covers."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from models.errors import PretrainedError

FETCH_HINT = (
    "fetch it once on a machine with access (`hf download {name}` or "
    "`AutoModel.from_pretrained('{name}').save_pretrained(DIR)` with its processor) and give "
    "the directory as `model`"
)
# What the Hub accepts as a model id: a name, or an owner and a name. Anything else is a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


def resolve(name: str) -> Path:
    """The model's directory: `name` itself, its snapshot in the local Hugging Face cache, or
    a directory of its name in $HCLIP_TOWERS_DIR (a model moved to another machine: a saved
    model names its towers by the paths they had where it was trained)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return _model_dir(path)
    moved = _in_towers_dir(path)
    if path.is_absolute() or name.startswith(".") or not HUB_ID.fullmatch(name):
        if moved is not None:
            return moved
        raise PretrainedError(f"model directory {path} does not exist{_elsewhere(path)}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the local cache (or not a valid id): no network here
        if moved is not None:
            return moved
        # "towers/clip" may be a folder or a hub id: the message serves both readings
        raise PretrainedError(
            f"model {name!r} is neither a directory (beside the config, or from the working "
            f"directory) nor in the local Hugging Face cache, nor in HCLIP_TOWERS_DIR. As a hub "
            f"id: {_hint(name)}. As a folder: `hf download HUB_ID --local-dir {name}` there"
        ) from None


def _model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise PretrainedError(f"{path}: no config.json, not a transformers model directory")
    return path.resolve()


def _in_towers_dir(path: Path) -> Path | None:
    towers = os.environ.get("HCLIP_TOWERS_DIR")
    if not towers or not (Path(towers) / path.name).is_dir():
        return None
    return _model_dir(Path(towers) / path.name)


def _elsewhere(path: Path) -> str:
    towers = os.environ.get("HCLIP_TOWERS_DIR")
    if towers:
        return f", nor does {Path(towers) / path.name} (HCLIP_TOWERS_DIR)"
    return (
        f": fetch the tower once on a machine with access (`hf download HUB_ID "
        f"--local-dir {path}`) or copy it there; for a model trained on another machine, set "
        f"HCLIP_TOWERS_DIR to a directory that holds it as {path.name}/"
    )


def _hint(name: str) -> str:
    return FETCH_HINT.format(name=name)


def identity(name: str) -> dict[str, Any]:
    """What the model fingerprint covers: the revision the cache or the config records and a
    hash of every file that defines the tower (weights, config, processor and tokenizer files),
    so a changed tower is another model and a moved or renamed one the same. The hash is read
    once per process and set of files (a tower's weights are GBs; fingerprints are asked for
    often)."""
    path = resolve(name)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    stats = tuple((str(f), st.st_size, st.st_mtime_ns, st.st_ino) for f in files
                  for st in [f.stat()])  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    revision = config.get("_commit_hash") or (path.name if path.parent.name == "snapshots" else "")
    return {"revision": revision, "files": _files_hash(str(path), stats)}


@functools.lru_cache(maxsize=64)
def _files_hash(root: str, stats: tuple[tuple[str, int, int, int], ...]) -> str:
    """sha256 over the files' relative names and bytes; `stats` (path, size, mtime, inode) is
    the cache key, so a changed file is read again."""
    h = hashlib.sha256()
    for f, *_ in stats:
        h.update(str(Path(f).relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
