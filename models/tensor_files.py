"""Reading and checking safetensors files: model weights, plugin towers, training checkpoints.

Every reader refuses pickles (torch.save files: unpickling can run arbitrary code), truncated
files, tensors whose name or shape does not fit the module, and non-finite values, with a
message naming the file and the tensor. Callers choose the exception type, so a user sees a
CheckpointError for a model directory and a PluginError for a plugin's tower.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


def check_not_pickle(path: Path, error: type[ValueError]) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    # torch.save writes a zip archive ("PK") or a raw pickle (protocol marker 0x80).
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise error(
            f"{path}: this is a pickled (torch.save) checkpoint; only safetensors are loaded, "
            "because unpickling can run arbitrary code"
        )
    if len(head) < 8:
        raise error(f"{path}: truncated safetensors file")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > path.stat().st_size - 8:
        raise error(f"{path}: corrupt safetensors header (truncated file?)")


def read_tensors(path: Path, error: type[ValueError]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    if not path.is_file():
        raise error(f"{path}: missing")
    check_not_pickle(path, error)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise error(f"{path}: corrupt safetensors file ({exc})") from None


def check_tensors(
    path: Path,
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    error: type[ValueError],
    wanted_by: str = "config",
) -> None:
    """Names and shapes equal to `expected` (a module's state_dict) and every float finite."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise error(f"{path}: tensor {missing[0]!r} is missing ({len(missing)} in all)")
    if unexpected:
        raise error(f"{path}: unexpected tensor {unexpected[0]!r} for this {wanted_by}")
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise error(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, {wanted_by} needs {want}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise error(f"{path}: tensor {name!r} holds NaN or infinite values")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(final: Path, tmp_prefix: str, fill: Callable[[Path], None]) -> Path:
    """Write a directory beside `final` under a temporary name (`fill(tmp)` writes its files),
    fsync it, and rename it into place: a crash at any point leaves the old `final` or the new
    one, never a mixture, and no temporary directory unless the process itself was killed."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=final.parent))
    try:
        fill(tmp)
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
