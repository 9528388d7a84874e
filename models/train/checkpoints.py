"""Resumable training checkpoints: everything a run needs to continue as if never stopped.

    CHECKPOINT_DIR/
      step-00000120/
        state.json            step, history, the run's config, optimiser groups, queue pointers
        tensors.safetensors   model.*, optim.<param index>.<name>, queue.*, rng.*

A checkpoint is written under a temporary name, fsynced and renamed into place, so a directory
named step-* is always complete; older ones are removed after the rename. A run killed at any
moment (SIGKILL included) leaves the last complete checkpoint to resume from. Like model
directories, checkpoints hold no pickle: tensors go to safetensors, the rest to JSON.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from models.checkpoint import CheckpointError
from models.tensor_files import read_tensors, replace_dir

STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def default_checkpoint_dir(out: Path) -> Path:
    """Next to the model directory, never inside it: --out only ever holds a finished model."""
    return out.with_name(out.name + ".checkpoints")


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = root

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def remove_partial(self) -> None:
        """Leftovers of a run killed while it wrote a checkpoint."""
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:08d}"

        def fill(tmp: Path) -> None:
            cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
            save_file(cpu, str(tmp / TENSORS_FILE), metadata={"format": "hclip-train"})
            state = {"format_version": FORMAT_VERSION, "step": step, **meta}
            (tmp / STATE_FILE).write_text(json.dumps(state) + "\n")

        replace_dir(final, f".tmp-{final.name}-", fill)
        for old in self.complete():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path / STATE_FILE}: unreadable ({exc})") from None
        if state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path / STATE_FILE}: unknown checkpoint format")
        return read_tensors(path / TENSORS_FILE, CheckpointError), state


def with_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tensors.items()}


def under_prefix(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


def optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """(tensors keyed '<param index>.<name>', JSON-able param groups)."""
    sd = opt.state_dict()
    tensors = {f"{i}.{name}": v for i, st in sd["state"].items() for name, v in st.items()}
    return tensors, sd["param_groups"]


def load_optimizer_state(
    opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], groups: list[Any]
) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return out


def load_rng_state(tensors: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    names = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))
    cuda = [tensors[k] for k in names]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
