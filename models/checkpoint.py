"""Model directories: `config.json` plus `model.safetensors`, written atomically, never pickled.

Loading checks every tensor's name and shape against the architecture that the config
describes, and refuses pickles, truncated files and non-finite weights with a message that
names the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.config import ConfigError, ModelConfig
from models.model import MultimodalModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A model directory is missing, corrupt, pickled, or does not match its config."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def prepare_out_dir(out: Path, overwrite: bool = False) -> None:
    """Refuse to clobber a non-empty --out unless asked, before any expensive work starts."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"--out {out}: directory is not empty (pass --overwrite to replace it)"
        )


def save_model(
    model: MultimodalModel,
    out: str | Path,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model directory next to `out` under a temporary name, then rename it into place.

    A crash at any point leaves either the old `out` or the new one, never a mixture.
    """
    out = Path(out)
    prepare_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "hclip"})
        config = {"format_version": FORMAT_VERSION, **model.cfg.to_dict(), **(extra or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_not_pickle(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    # torch.save writes a zip archive ("PK") or a raw pickle (protocol marker 0x80).
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise CheckpointError(
            f"{path}: this is a pickled (torch.save) checkpoint; only safetensors are loaded, "
            "because unpickling can run arbitrary code"
        )
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > path.stat().st_size - 8:
        raise CheckpointError(f"{path}: corrupt safetensors header (truncated file?)")


def read_config(model_dir: Path) -> tuple[ModelConfig, dict[str, Any]]:
    cfg_path = model_dir / CONFIG_FILE
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON (line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    try:
        cfg = ModelConfig.from_dict(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    return cfg, raw


def load_model(model_dir: str | Path) -> MultimodalModel:
    """Rebuild the architecture from config.json and load weights after checking every shape."""
    model_dir = Path(model_dir)
    cfg, _ = read_config(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    _check_not_pickle(weights)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights}: corrupt safetensors file ({exc})") from None
    model = MultimodalModel(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(
            f"{weights}: tensor {missing[0]!r} is missing ({len(missing)} in all)"
        )
    if unexpected:
        raise CheckpointError(f"{weights}: unexpected tensor {unexpected[0]!r} for this config")
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"{weights}: tensor {name!r} has shape {tuple(tensor.shape)}, config needs {want}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{weights}: tensor {name!r} holds NaN or infinite values")
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def fingerprint(model_dir: str | Path) -> str:
    """A content hash of the config's architecture and the weights: equal iff same model."""
    model_dir = Path(model_dir)
    cfg, _ = read_config(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    with open(model_dir / WEIGHTS_FILE, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]
