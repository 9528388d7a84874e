"""Training tuples: what a training source gives (decoded inputs per modality plus
duplicate-detection keys), and the in-memory source. models.train.records_file reads them from a
file on demand instead."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from models.config import ModelConfig
from models.encoders import decode
from models.limits import DEFAULT_LIMITS, InputError, InputLimits
from models.records import RecordError, iter_jsonl, record_id


def input_key(item: Any) -> int:
    """A stable 63-bit key of a decoded input: equal inputs, equal keys."""
    if isinstance(item, str):
        raw = item.encode("utf-8")
    elif isinstance(item, torch.Tensor):
        raw = item.numpy().tobytes()
    else:  # a PIL image (a plugin's decoded input): its mode, size and pixels
        raw = f"{item.mode}:{item.size}".encode() + item.tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


class TupleSource(Protocol):
    """Row-aligned training tuples: TupleDataset in memory, RecordsFile from disk."""

    def __len__(self) -> int: ...

    def batch(
        self, index: Sequence[int]
    ) -> tuple[dict[str, list[Any]], dict[str, torch.Tensor]]: ...


def check_modalities(obj: dict[str, Any], cfg: ModelConfig, line: int, rid: str) -> None:
    """A training record names only the model's modalities, and every one of them."""
    unknown = [k for k in obj if k not in cfg.modalities and k not in ("id", "payload")]
    if unknown:
        raise RecordError(
            f"unknown modality {unknown[0]!r} (model has: {', '.join(cfg.names)})", line, rid
        )
    for name in cfg.names:
        if name not in obj:
            raise RecordError(
                f"training records need every modality; {name!r} is missing", line, rid
            )


@dataclass
class TupleDataset:
    """Row-aligned decoded inputs for every modality of a model."""

    items: dict[str, list[Any]]
    keys: dict[str, torch.Tensor]  # (N,) int64 per modality

    def __len__(self) -> int:
        return len(next(iter(self.items.values())))

    @staticmethod
    def from_items(items: dict[str, list[Any]]) -> TupleDataset:
        sizes = {len(v) for v in items.values()}
        if len(sizes) != 1:
            raise ValueError("every modality needs the same number of rows")
        keys = {
            n: torch.tensor([input_key(x) for x in v], dtype=torch.int64) for n, v in items.items()
        }
        return TupleDataset(items=items, keys=keys)

    def batch(self, index: Sequence[int]) -> tuple[dict[str, list[Any]], dict[str, torch.Tensor]]:
        idx = torch.as_tensor(index)
        return {n: [v[i] for i in index] for n, v in self.items.items()}, {
            n: k[idx] for n, k in self.keys.items()
        }


def load_training_records(
    path: Path, cfg: ModelConfig, limits: InputLimits = DEFAULT_LIMITS
) -> TupleDataset:
    """Decode a whole records file into memory (small sets; `hclip train` reads lazily)."""
    items: dict[str, list[Any]] = {n: [] for n in cfg.names}
    seen: dict[str, int] = {}
    for line, obj in iter_jsonl(path):
        rid = record_id(obj, line)
        if rid in seen:
            raise RecordError(f"duplicate id, first seen on line {seen[rid]}", line, rid)
        seen[rid] = line
        check_modalities(obj, cfg, line, rid)
        for name in cfg.names:
            try:
                items[name].append(decode(obj[name], cfg.modalities[name], path.parent, limits))
            except InputError as exc:
                raise RecordError(f"{name}: {exc}", line, rid) from None
    if not seen:
        raise RecordError(f"{path}: no records")
    return TupleDataset.from_items(items)
