"""Pooled features of frozen pretrained towers, cached on disk across epochs and runs.

A frozen tower maps the same input to the same features every epoch, and it costs far more than
the trainable layers above it: its features are computed once per input and kept in an SQLite
file per tower (its fingerprint: name, revision and files, and the pooling), keyed by the
input's 63-bit hash (models.train.data.input_key, which training computes anyway to find
duplicates). SQLite (standard library) takes readers and writers from several DataLoader
workers at once; memory stays flat in the number of records.

Where the towers run: on the CPU, in the DataLoader workers (`CachedFeatures`); with an
accelerator, in the training process on it, the workers reading what the cache holds and
sending the decoded inputs of the rest (`gather`, then `complete` where the tower is).

    $HCLIP_FEATURE_CACHE (default ~/.cache/hclip/features)/<tower>/features.sqlite
    HCLIP_FEATURE_CACHE=off    no cache
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ConfigError
from models.encoders import Featurizer

DB = "features.sqlite"


def cache_root() -> Path | None:
    value = os.environ.get("HCLIP_FEATURE_CACHE")
    if value == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "hclip" / "features"


def tower_key(identity: dict[str, Any], pooling: str) -> str:
    return hashlib.sha256(repr((sorted(identity.items()), pooling)).encode()).hexdigest()[:20]


class FeatureStore:
    """One tower's features: input key -> float32 bytes, in `directory`/features.sqlite."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._db: sqlite3.Connection | None = None  # opened in the process that uses it
        # The file is made here, in the process that builds the loader, before its workers
        # start: processes opening a new file at once race on WAL mode ("database is locked").
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with closing(self._connect()) as db:
                db.execute("PRAGMA journal_mode=WAL")  # kept in the file
                db.execute("CREATE TABLE IF NOT EXISTS f (k INTEGER PRIMARY KEY, v BLOB NOT NULL)")
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(
                f"feature cache {directory / DB}: {exc} (HCLIP_FEATURE_CACHE sets where it "
                "lives; HCLIP_FEATURE_CACHE=off trains without it)"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_db": None}

    def close(self) -> None:
        db, self._db = getattr(self, "_db", None), None
        if db is not None:
            db.close()

    def __del__(self) -> None:
        self.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.directory / DB, timeout=60, isolation_level=None)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._connect()
        return self._db

    def read(self, wanted: list[int]) -> dict[int, bytes]:
        db = self._conn()
        found: dict[int, bytes] = {}
        for start in range(0, len(wanted), 500):  # SQLite's limit on bound variables
            part = wanted[start : start + 500]
            marks = ",".join("?" * len(part))
            found.update(db.execute(f"SELECT k, v FROM f WHERE k IN ({marks})", part).fetchall())
        return found

    def write(self, rows: list[tuple[int, bytes]]) -> None:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")  # one commit a batch, not one a row
        try:
            db.executemany("INSERT OR REPLACE INTO f (k, v) VALUES (?, ?)", rows)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


@dataclass
class PendingFeatures:
    """One batch's features of a frozen tower, before the tower ran: those the cache held, and
    the decoded inputs of the others, each input once however often the batch holds it."""

    keys: list[int]  # the batch's input keys, in order
    found: dict[int, bytes]
    missing: list[int]  # keys not found
    items: list[Any]  # their decoded inputs

    @property
    def computed(self) -> int:
        return len(self.missing)


def gather(items: list[Any], keys: torch.Tensor, store: FeatureStore | None) -> PendingFeatures:
    wanted = [int(k) for k in keys.tolist()]
    found = store.read(wanted) if store is not None else {}
    first: dict[int, int] = {}
    for i, k in enumerate(wanted):
        if k not in found:
            first.setdefault(k, i)
    return PendingFeatures(wanted, found, list(first), [items[i] for i in first.values()])


def complete(
    pending: PendingFeatures, featurizer: Featurizer, store: FeatureStore | None
) -> torch.Tensor:
    """(B, H) float32 on the CPU: the missing features computed by `featurizer` (and stored)."""
    found = dict(pending.found)
    if pending.missing:
        fresh = featurizer(pending.items).float().cpu().numpy()
        rows = [(k, fresh[j].tobytes()) for j, k in enumerate(pending.missing)]
        if store is not None:
            store.write(rows)
        found.update(rows)
    return torch.from_numpy(
        np.stack([np.frombuffer(found[k], dtype=np.float32) for k in pending.keys])
    )


class CachedFeatures:
    """A frozen featurizer behind the cache, where both run (a DataLoader worker): features of
    the inputs seen before are read, the others computed in one batch and stored."""

    def __init__(self, featurizer: Featurizer, directory: Path):
        self.featurizer = featurizer
        self.store = FeatureStore(directory)
        self.computed = 0  # inputs that went through the tower in this process

    def close(self) -> None:
        self.store.close()

    def __call__(self, items: list[Any], keys: torch.Tensor) -> torch.Tensor:
        pending = gather(items, keys, self.store)
        self.computed += pending.computed
        return complete(pending, self.featurizer, self.store)
