"""The versioned index artifact (docs/design.md §5): layout, manifests, checksums, atomic
publication.

    ROOT/CURRENT                    id of the published version, replaced atomically: the
                                    name of a directory in ROOT/versions, nothing else
    ROOT/versions/<id>/             complete before CURRENT names it, never modified afterwards;
                                    its manifest's `sequence` orders the publications
    ROOT/.staging/<id>/             a version being written; removed by the next run if it died
    ROOT/.lock                      held (filelock: flock) by the one build, update or gc running

A version directory is renamed into versions/ only after every file in it is fsynced, and
CURRENT is replaced only after that rename is durable, so a process killed at any point leaves
CURRENT and every published version untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3
from filelock import FileLock, Timeout

from indexer.store.arrays import start_writeback

log = logging.getLogger(__name__)

# 2: a memory-mapped record store (records/) replaced records.jsonl; 3: BLAKE3 checksums and
# the store's id hash named in the manifest. Format 2 is still read.
FORMAT_VERSION = 3
READS_FORMATS = (2, 3)
CURRENT = "CURRENT"
VERSIONS = "versions"
STAGING = ".staging"
LOCK = ".lock"
MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings"
VIEWS = "views"
REJECTED = "rejected.jsonl"


class ArtifactError(RuntimeError):
    """The index root or a version in it is missing, locked, or inconsistent."""


class BackendUnavailable(RuntimeError):
    """The store a version's views live in (Milvus, indexer.store.milvus) did not answer in
    time or refused the call: worth trying again; the service answers 503 meanwhile. `public`
    is what a client may be told (no addresses, no library's error text); the message has the
    detail, for the log and the command line."""

    def __init__(self, message: str, public: str = "the vector database is unavailable"):
        super().__init__(message)
        self.public = public


class VersionGone(ArtifactError):
    """A version that served lost what it is served from: its files under the root, or its
    collections in Milvus."""


class CurrentError(ArtifactError):
    """CURRENT names something other than a version directory inside the root."""


class StorageError(ArtifactError):
    """The filesystem failed a job (full, read-only, gone): what it was doing, where, and the
    free space there, in one line."""


FULL_BYTES = 1 << 20  # less free than this where a write fell short: the filesystem is full


def _readable_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@contextmanager
def removed_on_failure(root: Path, stage: Path) -> Iterator[None]:
    """The work on a staged version: on any failure the stage is removed (nothing is left
    behind), and a filesystem's (the disk full, say) becomes one line for the user."""
    try:
        yield
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        doing = f"writing version {stage.name} under {root}; nothing was published"
        raise storage_error(exc, doing, stage) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def storage_error(exc: OSError, doing: str, where: Path) -> StorageError:
    """`exc` (raised while `doing` something under `where`) as one line for the user."""
    path = Path(exc.filename) if exc.filename else where
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = exc.strerror or str(exc)  # numpy's short write has no errno: "N requested and M..."
    try:
        usage = shutil.disk_usage(probe)
        free = f"{_readable_bytes(usage.free)} free of {_readable_bytes(usage.total)} there"
        if exc.errno is None and usage.free < FULL_BYTES:
            why += " (the filesystem is full)"
    except OSError:
        free = "free space unknown"
    return StorageError(f"{doing}: {why} ({path}; {free})")


def new_version_id() -> str:
    """Sortable by creation time, unique across concurrent hosts."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z"
    return stamp + "-" + secrets.token_hex(3)


def _on_fd(path: Path, op: Callable[[int], object]) -> None:
    """`op` on a read-only descriptor of `path` (a file or a directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        op(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    _on_fd(path, os.fsync)


def fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def start_writeback_tree(path: Path) -> None:
    """Start writing every file's dirty pages to disk without waiting (indexer.store.arrays), so
    that the disk works while the cores check and the fsync after finds little left (files
    written whole by np.save, the id index and the views' rows, would wait for it)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            _on_fd(Path(dirpath) / f, start_writeback)


@contextmanager
def root_lock(root: Path, job: str) -> Iterator[None]:
    """Exclusive writer lock on ROOT for `job` (build, update, tune, gc, rollback), taken at once
    or not at all; an flock underneath, which the kernel releases when the holder dies (SIGKILL
    too). A filesystem that refuses the lock (read-only, gone) is one line naming the job."""
    lock = FileLock(root / LOCK, timeout=0)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise ArtifactError(
            f"{root}: another build, update or gc is running (it holds {root / LOCK})"
        ) from None
    except OSError as exc:
        raise storage_error(exc, f"{job}: taking the lock of the index root {root}", root) from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def doing(job: str, what: str, where: Path) -> Iterator[None]:
    """A filesystem's refusal while `job` does `what` under `where`, as one line naming them."""
    try:
        yield
    except OSError as exc:
        raise storage_error(exc, f"{job}: {what}", where) from None


# A killed run's encoders (Ray actors) can outlive it by a moment and finish the file they were
# writing into its staged version: removing that version is retried for this long.
STRAGGLER_S = 15.0


def clean_staging(root: Path) -> list[str]:
    """Remove what dead runs left; only call with the root lock held."""
    staging = root / STAGING
    removed = []
    if staging.is_dir():
        for entry in staging.iterdir():
            remove_tree(entry)
            removed.append(entry.name)
    for tmp in root.glob(f"{CURRENT}.tmp*"):
        tmp.unlink(missing_ok=True)
    if removed:
        log.warning("removed unfinished versions left by a dead run: %s", ", ".join(removed))
    return removed


def remove_tree(path: Path, within_s: float = STRAGGLER_S) -> None:
    """Remove `path` and what it holds, again while a writer that has not died yet adds a file
    under it (a directory that gained an entry cannot be removed); still there after
    `within_s`: a warning naming it, for the next run or `gc`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            shutil.rmtree(path)
            return
        except OSError as exc:
            if not path.exists():  # removed meanwhile
                return
            if exc.errno != errno.ENOTEMPTY or time.monotonic() > deadline:
                log.warning("could not remove %s (%s): the next run or gc removes it", path, exc)
                return
        time.sleep(0.1)


def staging_dir(root: Path, version_id: str) -> Path:
    path = root / STAGING / version_id
    (path / EMBEDDINGS).mkdir(parents=True)
    (path / VIEWS).mkdir()
    return path


def version_dir(root: Path, version_id: str) -> Path:
    return root / VERSIONS / version_id


def sha256_file(path: Path) -> str:
    """Format 2's checksum: the SHA-256 of the whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Format 3's checksum: BLAKE3 of the whole file, many times faster than SHA-256 on CPUs without
# SHA extensions, where SHA-256 took most of a build's time after encoding.
CHECKSUM = "blake3"


HASH_READ_BYTES = 4 << 20  # read in slices: a memory map would keep every page hashed resident


def blake3_file(path: Path, threads: int = blake3.blake3.AUTO) -> str:
    """Read in slices into one buffer: a memory map of the file (blake3's update_mmap) puts
    every page hashed in the process's resident set."""
    h = blake3.blake3(max_threads=threads)
    buf = bytearray(HASH_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # lets go of the GIL; spreads a slice over `threads`
    return str(h.hexdigest())


def list_files(vdir: Path) -> list[str]:
    """Every file of a version but its manifest, as paths relative to the version."""
    return [
        p.relative_to(vdir).as_posix()
        for p in sorted(vdir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    ]


def file_table(vdir: Path) -> dict[str, dict[str, Any]]:
    """Every file's checksum and size; a file under two names (a hard link) is read once."""
    table: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for rel in list_files(vdir):
        st = (vdir / rel).stat()
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen[key] = {CHECKSUM: blake3_file(vdir / rel), "bytes": st.st_size}
        table[rel] = dict(seen[key])
    return table


def file_matches(path: Path, meta: Mapping[str, Any]) -> bool:
    """A file against its manifest entry: blake3 (format 3) or sha256 (format 2)."""
    if CHECKSUM in meta:
        return blake3_file(path) == meta[CHECKSUM]
    return sha256_file(path) == meta.get("sha256")


SEQUENCE = "sequence"  # the manifest's place in the root's publications: 1, 2, ...


def sequence_of(vdir: Path) -> int:
    """A version's place in the order of publication; 0 for one published before the
    manifest recorded it (or unreadable): those come first, in the order of their ids."""
    try:
        seq = read_manifest(vdir).get(SEQUENCE)
    except ArtifactError:
        return 0
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else 0


def versions_in_order(root: Path) -> list[str]:
    """Every version under versions/, oldest publication first: by the manifests' sequence,
    not by the ids' timestamps, which a clock stepped back puts out of order."""
    vroot = root / VERSIONS
    if not vroot.is_dir():
        return []
    keyed = [(sequence_of(p), p.name) for p in vroot.iterdir() if p.is_dir()]
    return [name for _, name in sorted(keyed)]


def next_sequence(root: Path) -> int:
    """One past every publication so far; only with the root lock held."""
    vroot = root / VERSIONS
    seqs = [sequence_of(p) for p in vroot.iterdir() if p.is_dir()] if vroot.is_dir() else []
    return max(seqs, default=0) + 1


def publish(
    root: Path,
    stage: Path,
    manifest: dict[str, Any],
    check: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Start the disk on the staged files, checksum and check them, fsync them, move the
    staged version into versions/, then point CURRENT at it. `check` gets the staged directory
    once complete; any problem it names stops here."""
    version_id = manifest["version"]
    manifest[SEQUENCE] = next_sequence(root)
    start_writeback_tree(stage)
    # The checksums (blake3, which lets go of the GIL) are taken beside the check, which reads
    # the manifest without its file table.
    with ThreadPoolExecutor(1, thread_name_prefix="hclip-checksums") as pool:
        table = pool.submit(file_table, stage)  # the manifest is not among the files
        if check is not None:
            (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            problems = check(stage)
            if problems:
                first = "; ".join(problems[:3])
                raise ArtifactError(
                    f"version {version_id} failed its check before publishing: {first}"
                )
        manifest["files"] = table.result()
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    fsync_tree(stage)
    final = version_dir(root, version_id)
    final.parent.mkdir(exist_ok=True)
    os.rename(stage, final)
    fsync_path(final.parent)
    write_current(root, version_id)
    return final


def write_current(root: Path, version_id: str) -> None:
    tmp = root / f"{CURRENT}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(version_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CURRENT)
    fsync_path(root)


def read_current(root: Path) -> str | None:
    """What CURRENT says, unchecked (None: no CURRENT, or an empty one); `published` checks
    that it names a version of this root."""
    try:
        text = (root / CURRENT).read_bytes().decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return text or None


def current_problem(root: Path, version_id: str) -> str | None:
    """Why `version_id` (what CURRENT says) is not a version directory inside the root."""
    where = f"{root / CURRENT} names {version_id[:200]!r}"
    if version_id in (".", "..") or any(c in version_id for c in "/\\\0"):
        return f"{where}, which is not a version name (one directory name of {root / VERSIONS})"
    vdir = version_dir(root, version_id)
    if vdir.is_symlink() and vdir.resolve().parent != (root / VERSIONS).resolve():
        return f"{where}, a link to {vdir.resolve()}, outside {root / VERSIONS}"
    if not vdir.is_dir():
        return f"{where}, which is not in {root / VERSIONS} (removed?)"
    return None


def published(root: Path) -> str | None:
    """The version CURRENT names (None: nothing published yet); CurrentError, naming the path,
    when it names anything but a version directory inside the root. The one check of CURRENT:
    the service, verify, update, tune, rollback and gc all go through it."""
    version_id = read_current(root)
    if version_id is None:
        return None
    problem = current_problem(root, version_id)
    if problem is not None:
        raise CurrentError(problem)
    return version_id


def read_manifest(vdir: Path) -> dict[str, Any]:
    try:
        obj = json.loads((vdir / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{vdir}: no {MANIFEST}") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{vdir / MANIFEST}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("format_version"), int):
        raise ArtifactError(f"{vdir / MANIFEST}: unknown artifact format")
    if obj["format_version"] not in READS_FORMATS:
        raise ArtifactError(
            f"{vdir}: artifact format {obj['format_version']}, this hclip reads formats "
            f"{', '.join(map(str, READS_FORMATS))}: rebuild it with `hclip index build`"
        )
    return obj


def current_version_dir(root: Path) -> Path:
    vid = published(root)
    if vid is None:
        raise ArtifactError(f"{root}: no published version (run `hclip index build` first)")
    return version_dir(root, vid)


def list_versions(root: Path) -> list[dict[str, Any]]:
    """Every version, oldest publication first."""
    current = read_current(root)
    rows = []
    for vdir in (version_dir(root, v) for v in versions_in_order(root)):
        try:
            m = read_manifest(vdir)
        except ArtifactError as exc:
            rows.append({"version": vdir.name, "error": str(exc), "current": vdir.name == current})
            continue
        rows.append(
            {
                "version": vdir.name,
                "created": m.get("created"),
                "parent": m.get("parent"),
                "records": m.get("counts", {}).get("records"),
                "views": sorted(m.get("views", {})),
                "compact": bool(m.get("compact")),
                "current": vdir.name == current,
            }
        )
    return rows


def rollback(
    root: Path, to: str | None, check: Callable[[Path], list[str]]
) -> tuple[str | None, str]:
    """Point CURRENT at an older version (default: the one published before the published one),
    once `check` finds nothing wrong with it; as atomic as a publish. (was, now). With --to, a
    CURRENT that names no version of the root is mended; without, it is refused."""
    with root_lock(root, "rollback"):
        order = versions_in_order(root)
        if to is None:
            try:
                current = published(root)
            except CurrentError as exc:
                raise CurrentError(f"{exc}; name the version to publish with --to") from None
            older = order[: order.index(current)] if current in order else order
            if not older:
                raise ArtifactError(
                    f"{root}: no version older than the published one ({current}) to roll back to"
                )
            to = older[-1]
        else:
            try:
                current = published(root)
            except CurrentError as exc:
                log.warning("%s: rollback --to %s replaces it", exc, to)
                current = None
            if to not in order:
                raise ArtifactError(
                    f"{root}: no version {to!r} (`hclip index list --root {root}` lists them)"
                )
        if to == current:
            raise ArtifactError(f"{root}: version {to} is already the published one")
        problems = check(version_dir(root, to))
        if problems:
            raise ArtifactError(f"version {to} cannot be published again: {problems[0]}")
        with doing("rollback", f"pointing {root / CURRENT} at version {to}", root):
            write_current(root, to)
        return current, to


def gc(root: Path, keep: int) -> list[str]:
    """Keep the `keep` versions published last and the published one; remove the rest. A
    CURRENT that names no version of the root stops it: what it meant to keep is unknown."""
    if keep < 1:
        raise ArtifactError("gc: --keep must be at least 1")
    with root_lock(root, "gc"):
        current = published(root)
        with doing("gc", f"removing what dead runs left in {root / STAGING}", root):
            clean_staging(root)
        versions = versions_in_order(root)
        doomed = [v for v in versions[:-keep] if v != current]
        for v in doomed:
            # Rename first so that a crash mid-delete never leaves a half-version in versions/.
            trash = root / STAGING / f"gc-{v}"
            with doing("gc", f"removing version {v}", version_dir(root, v)):
                trash.parent.mkdir(exist_ok=True)
                os.rename(version_dir(root, v), trash)
                shutil.rmtree(trash)
        return doomed
