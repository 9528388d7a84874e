"""The Ray engine: Ray Data reads and checks the records and a pool of actors encodes them, on
a local Ray or a cluster; the driver assembles the version in input order.

    read (RecordSource)      one read task per JSON Lines file (lines numbered from its start)
                             or per Parquet row group (rows numbered from the footer), blocks of
                             up to CHUNK_ROWS records, each row tagged with its location
    check + encode (actors)  EncodeShards loads the model once per actor, checks a block with
                             the local engine's ChunkChecker, encodes the valid rows and writes
                             one shard (Arrow IPC: locations, ids, payloads, presence, one
                             embedding column per modality) into the staged version
    assemble (driver)        shards sorted by their first location, admitted in order
                             (indexer.ingest.admission: duplicate ids across shards, the first bad
                             record) and appended to the version's files, then removed

The driver never holds more than one shard. Shards live inside the staged version, so a killed
driver leaves them where every unfinished version is left, for the next run to remove; CURRENT
and the published versions are untouched, and Ray ends a dead driver's actors (and a local Ray
it started). Without --skip-bad, the first bad record a worker reports stops the encoding
everywhere (a STOP file among the shards) while checking goes on, so that the first bad line of
the input, not the first one found, is the one named.

Where Ray runs: a local Ray of the job's own (no address), a cluster this machine is a node of
(`auto`, `host:port`), or one reached through Ray Client (`ray://host:10001`): Ray Data's
executor cannot run in a Ray Client process, so there a task on the cluster runs it and sends
the shard summaries back through a queue. On a cluster, the model directory, the records and
the index root must be on storage that every node mounts at the same path.

Ray is imported here only: the local engine never needs it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.exceptions import RayTaskError

from indexer.build.encode import encode_rows
from indexer.build.ray_address import CLIENT_SCHEME, ClusterError, check_reachable
from indexer.build.writer import RowWriter
from indexer.ingest.admission import Admission
from indexer.ingest.checks import Checked, ChunkChecker, Reject
from indexer.ingest.sources import (
    CHUNK_ROWS,
    Chunk,
    RecordFiles,
    jsonl_chunks,
    open_parquet,
    parquet_chunks,
)
from indexer.ingest.validate import Rows, Validator
from models.checkpoint import fingerprint, load_model
from models.limits import DEFAULT_LIMITS, InputError
from models.model import MultimodalModel
from models.progress import Progress
from models.records import RecordError

log = logging.getLogger(__name__)

LOC = "__hclip_loc"  # the location column that every block carries
RAW = "__hclip_raw"  # a JSON line's bytes
SHARDS = "shards"  # inside the staged version (or its update side part)
STOP = "STOP"  # in SHARDS: a record is bad and the job will fail, so stop encoding
LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024  # a local Ray's shared memory: a few blocks


class RecordSource(Datasource):
    """Ray Data's view of a RecordFiles: read tasks that tag every record with its location."""

    def __init__(self, files: RecordFiles, rows: int = CHUNK_ROWS):
        self.files = files
        self.rows = rows

    def task_count(self) -> int:
        if not self.files.parquet:
            return len(self.files.files)
        return sum(open_parquet(p).num_row_groups for p in self.files.files)

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(p.stat().st_size for p in self.files.files)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        """One task per JSON Lines file (its lines are numbered from its start) and one per
        Parquet row group; `parallelism` is not ours to choose, the files decide."""
        tasks = []
        for index, path in enumerate(self.files.files):
            if self.files.parquet:
                for group in range(open_parquet(path).num_row_groups):
                    tasks.append(self._task(index, path, [group], per_task_row_limit))
            else:
                tasks.append(self._task(index, path, None, per_task_row_limit))
        return tasks

    def _task(
        self, index: int, path: Path, groups: list[int] | None, limit: int | None
    ) -> ReadTask:
        rows, parquet = self.rows, self.files.parquet

        def read() -> Iterator[pa.Table]:
            if parquet:
                for chunk in parquet_chunks(path, index, rows, groups):
                    table = pa.Table.from_batches([chunk.table])
                    yield table.append_column(LOC, pa.array(chunk.locs, pa.int64()))
            else:
                for chunk in jsonl_chunks(path, index, rows):
                    yield pa.table(
                        {
                            LOC: pa.array(chunk.locs, pa.int64()),
                            RAW: pa.array(chunk.lines, pa.binary()),
                        }
                    )

        size = path.stat().st_size
        if groups is not None:  # its share of the file
            size = size * len(groups) // max(1, open_parquet(path).num_row_groups)
        meta = BlockMetadata(
            num_rows=None, size_bytes=size, exec_stats=None, input_files=(str(path),)
        )
        return ReadTask(read, meta, per_task_row_limit=limit)


def chunk_of(table: pa.Table) -> Chunk:
    """A block back as the Chunk the checker takes."""
    locs = table.column(LOC).to_numpy().astype(np.int64)
    if RAW in table.column_names:
        return Chunk(locs, lines=table.column(RAW).to_pylist())
    rest = table.drop_columns([LOC])
    batch = pa.RecordBatch.from_arrays(
        [c.combine_chunks() for c in rest.columns], schema=rest.schema
    )
    return Chunk(locs, table=batch)


class EncodeShards:
    """A Ray Data actor: loads the model once, then checks, encodes and writes one shard per
    block, and returns one summary row per block."""

    def __init__(
        self,
        model_dir: str,
        base_dir: str,
        filter_fields: tuple[str, ...],
        filter_types: dict[str, str],
        shard_dir: str,
        batch_size: int,
        media_root: str | None = None,
    ):
        import torch

        torch.set_num_threads(1)  # one CPU per actor: Ray schedules them by it
        self.model = load_model(Path(model_dir))
        self.fingerprint = fingerprint(Path(model_dir))
        limits = replace(DEFAULT_LIMITS, media_root=Path(media_root) if media_root else None)
        validator = Validator(
            self.model,
            Path(base_dir),
            filter_fields=filter_fields,
            filter_types=filter_types,
            limits=limits,
        )
        self.checker = ChunkChecker(validator)
        self.shard_dir = Path(shard_dir)
        self.batch_size = batch_size

    def __call__(self, table: pa.Table) -> pa.Table:
        chunk = chunk_of(table)
        checked = self.checker.check(chunk)
        rows = checked.rows
        # Once a record is known bad (and not skipped), the job fails: checking goes on so
        # that every bad record is named (indexer.ingest.admission), but encoding would be wasted.
        encode = not (self.shard_dir / STOP).exists()
        embs = encode_rows(self.model, rows, self.batch_size) if encode and len(rows) else {}
        name = f"{int(chunk.locs[0]):016x}.arrow"
        write_shard(self.shard_dir / name, rows, self.model.names, embs)
        rejects = [[r.loc, r.id, r.reason, r.stage] for r in checked.rejects]
        return pa.table(
            {
                "shard": [name],
                "first": [int(chunk.locs[0])],
                "last": [int(chunk.locs[-1])],
                "rows": [len(rows)],
                "records": [len(chunk)],
                "rejects": [json.dumps(rejects)],
                "ignored": [json.dumps(checked.ignored)],
                "encoded": [bool(embs) or not len(rows)],
                "fingerprint": [self.fingerprint],
            }
        )


def write_shard(path: Path, rows: Rows, names: list[str], embs: dict[str, np.ndarray]) -> None:
    """Written under a temporary name and renamed: a shard that exists is complete."""
    columns: dict[str, Any] = {
        LOC: pa.array(rows.locs, pa.int64()),
        "id": pa.array(rows.ids, pa.string()),
        "payload": pa.array(rows.payloads, pa.binary()),
    }
    for j, n in enumerate(names):
        columns[f"has:{n}"] = pa.array(rows.presence[:, j], pa.bool_())
        if n in embs:
            e = np.ascontiguousarray(embs[n], dtype=np.float32)
            columns[f"emb:{n}"] = pa.FixedSizeListArray.from_arrays(
                pa.array(e.reshape(-1)), e.shape[1]
            )
    table = pa.table(columns)
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


def read_shard(path: Path, names: list[str], dim: int) -> tuple[Rows, dict[str, np.ndarray]]:
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
    rows = Rows(
        table.column(LOC).to_numpy().astype(np.int64),
        table.column("id").to_pylist(),
        table.column("payload").to_pylist(),
        np.stack(
            [table.column(f"has:{n}").to_numpy(zero_copy_only=False) for n in names], axis=1
        ).reshape(-1, len(names)),
        {},
    )
    embs = {}
    for n in names:
        if f"emb:{n}" in table.column_names:
            col = table.column(f"emb:{n}").combine_chunks()
            embs[n] = col.values.to_numpy().reshape(-1, dim).copy()
    return rows, embs


@dataclass(frozen=True)
class EncodePlan:
    """The dataset of one job: what the driver runs, or under Ray Client a task on the
    cluster runs for it (Ray Data's executor needs a process of the cluster)."""

    files: RecordFiles
    block_rows: int
    workers: int
    actor_kwargs: dict[str, Any]

    def dataset(self) -> ray.data.Dataset:
        quiet_ray_data()
        source = RecordSource(self.files, self.block_rows)
        # Reading takes no CPU of the job's: it is light next to checking and encoding, and
        # read tasks waiting for CPUs that the actors hold would stall the job.
        ds = ray.data.read_datasource(
            source, num_cpus=0, concurrency=max(1, min(self.workers, source.task_count()))
        )
        return ds.map_batches(
            EncodeShards,
            fn_constructor_kwargs=self.actor_kwargs,
            batch_size=None,  # one block, one shard
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=self.workers),
            num_cpus=1,
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        """Summary rows, one per shard, as the actors finish them."""
        for row in self.dataset().iter_rows():
            yield dict(row)

    def remote_rows(self) -> Iterator[dict[str, Any]]:
        """The same, from a task on the cluster, passed back through a queue as they come."""
        from ray.util.queue import Empty, Queue

        queue = Queue(maxsize=1000)
        done = _drive.remote(self, queue)
        try:
            while True:
                try:
                    row = queue.get(timeout=1.0)
                except Empty:
                    ready, _ = ray.wait([done], timeout=0)
                    if ready:
                        ray.get(done)  # raises the task's error, if it failed
                        if queue.empty():
                            return
                    continue
                if row is None:
                    ray.get(done)
                    return
                yield row
        finally:
            if not ray.wait([done], timeout=0)[0]:
                ray.cancel(done, force=True)  # the driver stopped reading: stop the job
            queue.shutdown()


@ray.remote(num_cpus=0)
def _drive(plan: EncodePlan, queue: Any) -> None:
    for row in plan.rows():
        queue.put(row)
    queue.put(None)


def ray_client() -> bool:
    """Connected through Ray Client (ray://): this process is no node of the cluster."""
    from ray.util.client import ray as client

    return bool(client.is_connected())


class RayJob:
    """One build's or update's encoding on Ray."""

    def __init__(
        self,
        model_dir: Path,
        address: str | None,
        workers: int | None,
        batch_size: int,
        progress: bool,
    ):
        self.model_dir = model_dir.resolve()
        self.address = address
        self.workers = workers
        self.batch_size = batch_size
        self.progress = progress

    def run(
        self,
        model: MultimodalModel,
        files: RecordFiles,
        validator: Validator,
        admission: Admission,
        writer: RowWriter,
        block_rows: int = CHUNK_ROWS,
    ) -> int:
        """Encode every record of `files` on Ray, `block_rows` records per block (and shard),
        and append the admitted rows to `writer` in input order; returns the rows written."""
        shard_dir = writer.vdir / SHARDS
        shard_dir.mkdir()
        try:
            with ray_session(self.address, self.workers) as cpus:
                workers = self.workers or max(1, cpus)  # reading takes no CPU of its own
                if workers > cpus:  # an autoscaling cluster may grow to it; others wait forever
                    log.warning("%d workers asked for, the Ray cluster has %d CPUs", workers, cpus)
                summaries = self._encode(
                    files, validator, shard_dir, workers, admission.skip_bad, block_rows
                )
            return self._assemble(model, summaries, shard_dir, admission, writer)
        finally:
            shutil.rmtree(shard_dir, ignore_errors=True)

    def _encode(
        self,
        files: RecordFiles,
        validator: Validator,
        shard_dir: Path,
        workers: int,
        skip_bad: bool,
        block_rows: int,
    ) -> list[dict[str, Any]]:
        resolved = RecordFiles(tuple(p.resolve() for p in files.files), files.parquet)
        media_root = validator.limits.media_root
        plan = EncodePlan(
            resolved,
            block_rows,
            workers,
            {
                "model_dir": str(self.model_dir),
                "base_dir": str(resolved.base_dir),
                "filter_fields": tuple(validator.filter_fields),
                "filter_types": dict(validator.filter_types),
                "shard_dir": str(shard_dir.resolve()),
                "batch_size": self.batch_size,
                "media_root": None if media_root is None else str(media_root),
            },
        )
        expected = fingerprint(self.model_dir)
        summaries = []
        bar = Progress(desc="encode", unit="rec", disable=not self.progress)
        rows = plan.remote_rows() if ray_client() else plan.rows()
        try:
            for row in rows:
                if row["fingerprint"] != expected:
                    raise RecordError(
                        f"a Ray worker loaded a different model from {self.model_dir} "
                        f"(fingerprint {row['fingerprint']}, expected {expected}): the path "
                        "must name the same model on every node"
                    )
                if not skip_bad and row["rejects"] != "[]":
                    (shard_dir / STOP).touch()
                summaries.append(row)
                bar.update(row["records"])
        except RayTaskError as exc:  # a worker's own error: the user's, or a bug
            cause: BaseException | None = exc
            while isinstance(cause, RayTaskError):  # a task's error, raised in a task ...
                cause = cause.cause
            if isinstance(cause, RecordError | InputError):
                raise cause from None
            raise
        finally:
            bar.close()
        return summaries

    def _assemble(
        self,
        model: MultimodalModel,
        summaries: list[dict[str, Any]],
        shard_dir: Path,
        admission: Admission,
        writer: RowWriter,
    ) -> int:
        """Admit every shard's records in input order and write the admitted rows."""
        ordered = sorted(summaries, key=lambda s: s["first"])
        for before, after in pairwise(ordered):
            if after["first"] <= before["last"]:
                raise RecordError(f"shards overlap at location {after['first']}: a Ray bug")
        names, dim = model.names, model.cfg.latent_dim
        partial = any(not s["encoded"] for s in ordered)
        written = 0
        for s in ordered:
            rows, embs = read_shard(shard_dir / s["shard"], names, dim)
            rejects = [
                Reject(loc, rid, reason, stage)
                for loc, rid, reason, stage in json.loads(s["rejects"])
            ]
            keep = admission.admit(Checked(rows, rejects, json.loads(s["ignored"])))
            if partial:
                continue  # some shards were not encoded: admission holds a bad record
            kept = rows.take(keep)
            if len(kept):
                writer.write_rows(
                    kept.ids,
                    kept.payloads,
                    kept.presence,
                    {n: e[keep] for n, e in embs.items()},
                )
            written += len(kept)
        admission.bad.raise_any()  # the job's engine.encode_records says what was ignored
        if partial:
            raise RecordError("encoding stopped at a bad record, but none was found: a bug")
        return written


def quiet_ray_data() -> None:
    """The job's own progress bar says how far it is: none of Ray Data's bars and banners."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # It would warn, once per process, that the bars just turned off are off.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


CLIENT_TRIES = 3  # starts of a Ray Client server per job before its failure is the job's
CLIENT_RETRY_S = 2.0


def connect(address: str, kwargs: dict[str, Any]) -> None:
    """ray.init on an existing cluster, once its address is known to answer
    (indexer.build.ray_address). Through Ray Client (`ray://`), the cluster starts a server process
    for each client, and that start fails now and then on its side: the process dies while it
    is forked (ray-project/ray#63202), and the client is told "Initialization failure from
    server" (ConnectionAbortedError). The next start usually works (seen in this project's
    CI), so a ray:// address gets CLIENT_TRIES of them. A cluster that cannot be joined ends
    the job with a ClusterError that names the address."""
    check_reachable(address)
    for attempt in range(1, CLIENT_TRIES + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except ConnectionAbortedError as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if not address.startswith(CLIENT_SCHEME) or attempt == CLIENT_TRIES:
                tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                raise ClusterError(
                    f"--ray-address {address}: the cluster did not take this job "
                    f"({tries}; the last: {reason})"
                ) from exc
            log.warning(
                "the Ray cluster at %s failed to start this client's server (%s); "
                "trying again (%d of %d)",
                address,
                reason,
                attempt + 1,
                CLIENT_TRIES,
            )
            ray.shutdown()  # whatever the failed connection left behind
            time.sleep(CLIENT_RETRY_S)
        except ConnectionError as exc:  # `auto` with no cluster on this machine, for one
            raise ClusterError(f"--ray-address {address}: {exc}") from exc


@contextmanager
def ray_session(address: str | None, workers: int | None) -> Iterator[int]:
    """Ray for one job: an existing cluster (`address`), the Ray this process already runs, or
    a local one started here and stopped afterwards. Yields the CPUs Ray offers."""
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "logging_level": logging.WARNING,
            "log_to_driver": False,
            "configure_logging": False,
        }
        if address:
            connect(address, kwargs)
        else:
            cpus = workers or os.cpu_count() or 1
            ray.init(
                # "local": a Ray of this job's own, even when another one runs on this machine
                # (ray.init() alone would join the one `ray start` last recorded in /tmp/ray)
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                **kwargs,
            )
        started = True
    try:
        yield int(ray.cluster_resources().get("CPU", 1))
    finally:
        if started:
            ray.shutdown()
