"""Training tuples: what a training source gives (decoded inputs per modality plus
duplicate-detection keys), and the in-memory source. models.train.records_file reads them from a
file on demand instead."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from models.config import ModelConfig
from models.encoders import decode
from models.limits import DEFAULT_LIMITS, InputError, InputLimits
from models.records import RecordError, closest, ignored_line, iter_jsonl, record_id

log = logging.getLogger(__name__)


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


def check_modalities(obj: dict[str, Any], cfg: ModelConfig, line: int, rid: str) -> list[str]:
    """A record for training or evaluation has every modality of the model; returns its other
    fields (no modality of the model), which are left out."""
    extra = [k for k in obj if k not in cfg.modalities and k not in ("id", "payload")]
    for name in cfg.names:
        if name not in obj:
            typo = closest(name, extra)
            hint = f" (the record has {typo!r}: a typo?)" if typo else ""
            raise RecordError(
                f"modality {name!r} is missing (the model needs all of {', '.join(cfg.names)})"
                + hint,
                line,
                rid,
            )
    return extra


class IgnoredFields:
    """Fields of the records that no modality of the model takes: named in one line at the
    end of a scan."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}  # field -> first line

    def add(self, fields: list[str], line: int) -> None:
        for name in fields:
            self.first.setdefault(name, line)

    def report(self, cfg: ModelConfig) -> None:
        if self.first:
            where = {k: f"line {v}" for k, v in sorted(self.first.items())}
            log.warning("%s", ignored_line(where, cfg.names))


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
    ignored = IgnoredFields()
    for line, obj in iter_jsonl(path):
        rid = record_id(obj, line)
        if rid in seen:
            raise RecordError(f"duplicate id, first seen on line {seen[rid]}", line, rid)
        seen[rid] = line
        ignored.add(check_modalities(obj, cfg, line, rid), line)
        for name in cfg.names:
            try:
                items[name].append(decode(obj[name], cfg.modalities[name], path.parent, limits))
            except InputError as exc:
                raise RecordError(f"{name}: {exc}", line, rid) from None
    if not seen:
        raise RecordError(f"{path}: no records")
    ignored.report(cfg)
    return TupleDataset.from_items(items)
