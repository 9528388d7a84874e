"""What an `index build` or `index update` job is asked (JobOptions) and what it answers
(JobResult, and its summary lines for the command line)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from indexer.ingest.sources import CHUNK_ROWS
from indexer.search.specs import IndexSpec, SpecError
from models.limits import DEFAULT_LIMITS, InputLimits

if TYPE_CHECKING:
    from indexer.ingest.validate import Rejected


@dataclass
class JobOptions:
    spec: IndexSpec = field(default_factory=lambda: IndexSpec("flat"))
    views: list[tuple[str, ...]] | None = None  # None: the default set (docs/design.md §4)
    batch_size: int = 256
    skip_bad: bool = False
    progress: bool = True
    check: bool = True  # the full verification of the staged version before it is published
    filter_fields: tuple[str, ...] | None = None  # None: none at build, the old ones at update
    engine: str = "local"  # or "ray" (indexer.build.ray_engine)
    ray_address: str | None = None  # None: a local Ray started and stopped by the job
    workers: int | None = None  # Ray encoding actors; None: one per CPU that Ray offers
    chunk_rows: int = CHUNK_ROWS  # records checked at once (local), per block and shard (Ray)
    backend: str | None = None  # "faiss" or "milvus"; None: the root's (ROOT/backend.json)
    milvus_uri: str | None = None  # None: the root's
    shards: int = 1  # Milvus shards per collection
    device: str = "auto"  # where the local engine encodes: auto (a GPU if any), cpu, cuda
    media_root: Path | None = None  # where records' media paths may lead; None: their folder
    # float16 embeddings and views stored as codes (indexer.build.compact); None: full at a
    # build, the version's own at an update
    compact: bool | None = None

    def input_limits(self) -> InputLimits:
        """What decoding a record may read: files inside media_root (else the records file's
        folder), with the default size limits."""
        if self.media_root is None:
            return DEFAULT_LIMITS
        if not Path(self.media_root).is_dir():
            raise SpecError(f"--media-root {self.media_root}: not a directory")
        return replace(DEFAULT_LIMITS, media_root=Path(self.media_root).resolve())


@dataclass
class JobResult:
    version: str
    path: Path
    manifest: dict[str, Any]
    rejected: list[Rejected] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, for benchmarks


def summary(result: JobResult) -> Iterator[str]:
    m = result.manifest
    yield f"published version {result.version} ({m['counts']['records']} records)"
    for name, v in m["views"].items():
        kind, recall = v["spec"]["kind"], v["recall_at_10"]
        stores = f"  stores {v['stores']}" if "stores" in v else ""  # a compact version's
        yield f"  view {name:<20} {v['count']:>9} records  {kind:<6} recall@10 {recall}{stores}"
    for r in result.rejected:
        yield f"  rejected {r.where()}: {r.reason}"
