"""The loaded version and its hot swap.

A request takes the ServingVersion that is current when it starts and uses it to the end, so
it finishes on the old version even if a new one is swapped in meanwhile; the old version's
memory maps close when the last such request lets go of it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.core.errors import VersionRejected
from app.core.metrics import Metrics
from app.core.settings import Settings
from app.services.batching import (
    MicroBatcher,
    SearchItem,
    SearchResult,
    encode_batcher,
    query_factors,
    search_batcher,
)
from app.services.heap import HeapSettler
from app.services.threads import WorkerPools
from app.services.workers import WorkerBoard
from indexer.store import artifact
from indexer.store.checked import CheckedVersions, signature
from indexer.store.milvus_served import MilvusVersion
from indexer.store.verify import verify_contents, verify_files
from indexer.store.version import LoadedVersion
from models.checkpoint import fingerprint, load_model
from models.encoders.runtime import Runtime
from models.extras import ExtraMissing
from models.model import MultimodalModel

log = logging.getLogger(__name__)
EMPTY_ROOT_LOG_S = 60.0  # how often a root with no published version is said so
PROBE_TTL_S = 1.0  # /readyz probes the served version at most this often


class FailedChecks(VersionRejected):
    """A version whose files do not match its manifest: refused until its files change."""


def signature_or_none(vdir: Path) -> str | None:
    try:
        return signature(vdir)
    except OSError:
        return None


Served = LoadedVersion | MilvusVersion


def open_milvus(
    vdir: Path, manifest: dict[str, Any], uri: str | None, timeout_s: float
) -> MilvusVersion:
    """A version whose views live in Milvus (`manifest`, read from `vdir`): nothing else is
    read here; its collections must exist, hold the manifest's counts and load."""
    if manifest.get("version") != vdir.name:
        raise FailedChecks(
            f"version {vdir.name} failed verification: its manifest names version "
            f"{manifest.get('version')!r}"
        )
    try:
        return MilvusVersion(vdir, manifest, uri, timeout_s)
    except (artifact.ArtifactError, artifact.BackendUnavailable, KeyError, ValueError) as exc:
        raise VersionRejected(f"version {vdir.name} cannot be opened: {exc}") from None


def milvus_manifest(vdir: Path) -> dict[str, Any] | None:
    """The manifest of a version on the milvus backend, else None (a FAISS version, or one
    whose manifest the checks below will name as broken)."""
    try:
        manifest = artifact.read_manifest(vdir)
    except artifact.ArtifactError:
        return None
    return manifest if (manifest.get("backend") or {}).get("kind") == "milvus" else None


def open_checked(vdir: Path, level: str, checked: CheckedVersions | None = None) -> LoadedVersion:
    """Open a version for serving after the checks `level` asks for (see indexer.store.verify):
    "checksums" reads every file once per machine (`checked` remembers what passed), "quick"
    costs the same whatever the record count, "full" reads and recomputes it all."""
    version_id = vdir.name
    if level == "checksums" and checked is not None:
        problems = checked.check(vdir, verify_files)
    else:
        problems = verify_files(vdir, full=level != "quick") if level != "off" else []
    if problems:
        raise FailedChecks(f"version {version_id} failed verification: {problems[0]}")
    try:
        index = LoadedVersion(vdir)
    except (artifact.ArtifactError, OSError, RuntimeError, ValueError, KeyError) as exc:
        raise VersionRejected(f"version {version_id} cannot be opened: {exc}") from None
    if index.version != version_id:  # a copy under another name: it would reload forever
        raise FailedChecks(
            f"version {version_id} failed verification: its manifest names version "
            f"{index.version!r}"
        )
    problems = verify_contents(vdir) if level == "full" else []
    if problems:
        raise FailedChecks(f"version {version_id} failed verification: {problems[0]}")
    return index


@dataclass
class ServingVersion:
    index: Served
    model: MultimodalModel
    searchers: dict[str, MicroBatcher[SearchItem, SearchResult]] = field(
        default_factory=dict
    )  # one per view
    encoders: dict[str, MicroBatcher[Any, np.ndarray]] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint


@torch.inference_mode()
def warm_up(serving: ServingVersion) -> None:
    """Run every encoder that can make an example of its input once, and search every view
    with a query of one row and a small batch: lazy initialisations happen now, and the views'
    pages are mapped in, before the version takes a request."""
    model = serving.model
    embs = {}
    for name in model.names:
        enc = model.encoder(name)
        example = enc.example(enc.cfg)
        if example is not None:
            embs[name] = model.encode(name, [example])[0].numpy()
    rng = np.random.default_rng(0)
    d = model.cfg.latent_dim
    for view in serving.index.views.values():
        for rows in (1, 8):
            items = [
                SearchItem({m: embs.get(m, rng.standard_normal(d).astype(np.float32))
                            for m in view.query}, 10)
                for _ in range(rows)
            ]  # fmt: skip
            xq = query_factors(model.head, view, items)
            view.search(xq, 10)


@dataclass
class Rejection:
    """A version that could not be loaded, and when the poller will try it again."""

    reason: str
    attempts: int
    retry_at: float  # time.monotonic()
    # Set for files that failed their checks: not tried again until the files change (their
    # signature, indexer.store.checked) or an admin reload asks.
    files: str | None = None


class VersionManager:
    """Loads the version CURRENT names and swaps it in; retries a rejected one with backoff,
    since what failed may be transient (a model volume not mounted yet, a disk hiccup)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        pools: WorkerPools,
        board: WorkerBoard | None = None,
    ):
        self.settings = settings
        self.root = Path(settings.root)
        self.metrics = metrics
        self.pools = pools
        self.current: ServingVersion | None = None
        self.rejected: dict[str, Rejection] = {}
        self._models: dict[str, MultimodalModel] = {}
        self._lock = asyncio.Lock()
        self._loaded = asyncio.Event()  # set once a version serves
        self._told_empty = -math.inf  # when the root was last said to hold no version
        self.health: str | None = None  # why the served version cannot answer, by its last probe
        self._probed_at = -math.inf
        self._probe_lock = asyncio.Lock()
        self.fallback: str | None = None  # why no version serves in place of a missing one
        self.checked = CheckedVersions(settings.checked_dir)
        self.board = board or WorkerBoard(None, 1)  # tells the other workers what this serves
        self.heap = HeapSettler()  # frozen once the requests on a replaced version are over

    def _open(self, version_id: str) -> ServingVersion:
        """Blocking: check and open a version, load (or reuse) its model, build its workers,
        and warm its search path up, so that its first request costs what every other does."""
        vdir = artifact.version_dir(self.root, version_id)
        s = self.settings
        index: Served
        manifest = milvus_manifest(vdir)
        if manifest is not None:
            index = open_milvus(vdir, manifest, s.milvus_uri, s.milvus_timeout_s)
        else:
            index = open_checked(vdir, s.verify_on_load, self.checked)
        model = self._model_for(index)
        serving = self._serving(index, model)
        t0 = time.perf_counter()
        try:
            warm_up(serving)
        except artifact.BackendUnavailable as exc:
            raise VersionRejected(f"version {version_id} cannot be warmed up: {exc}") from None
        log.debug("version %s warmed up in %.3f s", version_id, time.perf_counter() - t0)
        return serving

    def _model_for(self, index: Served) -> MultimodalModel:
        """The model that built `index`, loaded once and shared by its later versions."""
        model = self._models.get(index.fingerprint)
        if model is not None:
            return model
        model_dir = Path(index.manifest["model"]["path"])
        try:  # CheckpointError is a ValueError
            found = fingerprint(model_dir)
            if found != index.fingerprint:
                raise VersionRejected(
                    f"model at {model_dir} (fingerprint {found}) is not the one that built "
                    f"version {index.version} ({index.fingerprint})"
                )
            model = load_model(model_dir).to_inference(
                self.settings.device, field="HCLIP_DEVICE", runtime=self._runtime(model_dir)
            )
        except (OSError, ValueError, ExtraMissing) as exc:
            raise VersionRejected(f"model of version {index.version}: {exc}") from None
        self._models = {index.fingerprint: model}  # keep only the model in use
        return model

    def _runtime(self, model_dir: Path) -> Runtime:
        """HCLIP_ENCODER_RUNTIME for this model: its graphs beside it, on the encode threads."""
        s = self.settings
        return Runtime(s.encoder_runtime, model_dir / "onnx", s.encode_threads)

    def _serving(self, index: Served, model: MultimodalModel) -> ServingVersion:
        s = self.settings
        serving = ServingVersion(index, model)
        wait_s = s.batch_wait_ms / 1000.0
        on_loop = s.searches_on_loop()
        for name, view in index.views.items():
            serving.searchers[name] = search_batcher(
                view, model.head, self.pools.search, s.batch_max, wait_s,
                self.metrics.batch_size.observe, s.max_pending, index.mask_of,
                # a remote view's search waits on the network: on the search thread, never inline
                on_loop and not view.remote,
            )  # fmt: skip
        limits = s.input_limits()
        for name in model.names:
            serving.encoders[name] = encode_batcher(
                model, name, self.pools.encoder(name), s.batch_max, wait_s, limits, s.max_pending,
                self.metrics.encode_batch_size.labels(name).observe, self.pools.core_share,
                # ONNX Runtime computes its towers on its own threads, not torch's OpenMP teams
                None if s.encoder_runtime != "torch" else self.pools.team, s.encode_threads,
            )  # fmt: skip
        return serving

    def _relative(self, reason: str) -> str:
        """A reason as /v1/info shows it: paths under the root named relative to it."""
        for root in {str(self.root.resolve()), str(self.root)}:
            reason = reason.replace(root + "/", "")
        return reason

    def _reject(self, version_id: str, reason: str, files: str | None) -> Rejection:
        previous = self.rejected.get(version_id)
        attempts = previous.attempts + 1 if previous else 1
        s = self.settings
        delay = min(s.reload_retry_max_s, s.reload_retry_s * 2 ** (attempts - 1))
        rejection = Rejection(self._relative(reason), attempts, time.monotonic() + delay, files)
        self.rejected[version_id] = rejection
        self.metrics.reloads.labels(outcome="rejected").inc()
        self.metrics.rejected_versions.set(len(self.rejected))
        retry = (
            "not trying it again until its files change"
            if files is not None
            else f"trying again in {delay:.0f} s"
        )
        log.error(
            "%s; still serving %s; %s (attempt %d)",
            rejection.reason,
            self.current.version if self.current else "nothing",
            retry,
            attempts,
        )
        return rejection

    def _retry_due(self, version_id: str, rejected: Rejection) -> bool:
        if rejected.files is not None:  # failed its checks: only new files deserve another
            return signature_or_none(artifact.version_dir(self.root, version_id)) != rejected.files
        return time.monotonic() >= rejected.retry_at

    def _forget_rejections(self, keep: str | None = None) -> None:
        """Forget every refusal but `keep`'s (the version CURRENT names)."""
        if set(self.rejected) - {keep}:
            self.rejected = {v: r for v, r in self.rejected.items() if v == keep}
            self.metrics.rejected_versions.set(len(self.rejected))

    async def refresh(self, force: bool = False) -> bool:
        """Load the version CURRENT names if it is new; True when a swap happened. A version
        rejected before is tried again once its backoff has passed (at once when forced). When
        CURRENT names no version directory of the root (garbage, a path, a version removed),
        that is reported and the newest version that loads serves instead (`_fall_back`)."""
        async with self._lock:
            version_id = artifact.read_current(self.root)
            if version_id is None:
                return False
            problem = artifact.current_problem(self.root, version_id)
            if problem is not None:
                return await self._fall_back(version_id, problem, force)
            self.fallback = None
            if self.current is not None and self.current.version == version_id:
                self._forget_rejections()  # CURRENT went back to what serves: nothing refused
                return False
            self._forget_rejections(keep=version_id)  # only the version CURRENT names matters
            return await self._load(version_id, force)

    async def _load(self, version_id: str, force: bool) -> bool:
        """Open `version_id` and swap it in (True), unless it was refused and its retry is not
        due (False); VersionRejected, recorded, when it cannot be served."""
        rejected = self.rejected.get(version_id)
        if rejected is not None and not force and not self._retry_due(version_id, rejected):
            return False
        vdir = artifact.version_dir(self.root, version_id)
        files = signature_or_none(vdir)  # before the checks: what they will have read
        t0 = time.perf_counter()
        try:
            serving = await asyncio.get_running_loop().run_in_executor(None, self._open, version_id)
        except VersionRejected as exc:
            lasting = isinstance(exc, FailedChecks) and files is not None
            self._reject(version_id, exc.message, files if lasting else None)
            raise
        took = time.perf_counter() - t0
        self.metrics.load_seconds.set(took)
        old = self.current
        self.current = serving
        self.heap.settle_in(0.0 if old is None else self.settings.request_timeout_s)
        self.health, self._probed_at = None, time.monotonic()  # it answered its warm-up
        self._loaded.set()
        self.rejected.pop(version_id, None)
        self.metrics.rejected_versions.set(len(self.rejected))
        self.metrics.set_version(version_id)
        self.board.serving(version_id)
        self.metrics.reloads.labels(outcome="loaded").inc()
        log.info(
            "serving version %s (was %s), opened in %.3f s",
            version_id,
            old.version if old else "none",
            took,
        )
        return True

    async def _fall_back(self, named: str, problem: str, force: bool) -> bool:
        """CURRENT names `named`, which is no version of the root (`problem`): reported as
        refused; what serves serves on if it can answer and is not `named` itself, else the
        newest version, in the order of publication, that loads serves instead."""
        if named not in self.rejected:
            self._reject(named, problem, None)
        serving = self.current
        if serving is not None and serving.version == named:  # removed from under this worker
            self._drop(serving, problem)
        elif serving is not None and self.health is None:
            return False
        others = [v for v in reversed(artifact.versions_in_order(self.root)) if v != named]
        for version_id in others:
            try:
                if await self._load(version_id, force):
                    self.fallback = None
                    log.warning("%s: serving version %s instead", problem, version_id)
                    return True
            except VersionRejected:
                continue
        tried = "; ".join(f"{v}: {self.rejected[v].reason}" for v in others if v in self.rejected)
        self.fallback = (
            f"no other version in {self.root / artifact.VERSIONS} to serve instead"
            if not others
            else f"no other version can be served instead ({tried or 'none loaded yet'})"
        )
        return False

    def _drop(self, serving: ServingVersion, reason: str) -> None:
        """Stop serving a version that can no longer answer (its files or collections gone):
        requests that hold it finish on it; new ones are told why nothing serves."""
        if self.current is not serving:
            return
        self.current = None
        self._loaded.clear()
        self.heap.settle_in(self.settings.request_timeout_s)
        if serving.version not in self.rejected:
            self._reject(serving.version, reason, None)
        self.board.failing(self._relative(reason))

    async def probe(self, max_age_s: float = PROBE_TTL_S) -> str | None:
        """Why the served version cannot answer now (None: it can, or nothing serves), from a
        probe at most `max_age_s` old: a stat per file, or each Milvus collection looked up
        (and loaded when released). A version whose files or collections are gone stops
        serving (`_drop`), and the next refresh looks for one to serve."""
        async with self._probe_lock:
            serving = self.current
            if serving is None or time.monotonic() - self._probed_at < max_age_s:
                return self.health if serving is not None else None
            health: str | None = None
            try:
                await asyncio.get_running_loop().run_in_executor(None, serving.index.probe)
            except artifact.VersionGone as exc:
                self._drop(serving, str(exc))
            except artifact.BackendUnavailable as exc:
                health = self._relative(f"version {serving.version} cannot answer: {exc}")
            self._probed_at = time.monotonic()
            if self.current is serving and health != self.health:
                if health is None:
                    self.board.serving(serving.version)
                else:
                    self.board.failing(health)
            self.health = health if self.current is serving else None
            return self.health

    def warning(self) -> str | None:
        """Why what serves is not the version CURRENT names, when CURRENT names none of the
        root's (what /readyz adds to its 200)."""
        named = artifact.read_current(self.root)
        if named is None or self.current is None or self.current.version == named:
            return None
        problem = artifact.current_problem(self.root, named)
        if problem is None:
            return None
        return self._relative(f"{problem}; serving version {self.current.version} instead")

    def publish_hint(self) -> str:
        root = self.root.resolve()
        return (
            f"no index version is published in {root} yet: publish one with `hclip index "
            f"build --model MODEL_DIR --records RECORDS --root {root}`"
        )

    def not_ready(self) -> str:
        """Why no version serves, for /readyz, a request refused and the log."""
        version_id = artifact.read_current(self.root)
        if version_id is None:
            return self.publish_hint()
        problem = artifact.current_problem(self.root, version_id)
        if problem is not None:
            then = self.fallback or "looking for another version to serve"
            return self._relative(f"{problem}; {then}")
        rejected = self.rejected.get(version_id)
        if rejected is not None:
            return f"version {version_id} cannot be served: {rejected.reason}"
        return f"version {version_id} is being loaded"

    def _tell_if_empty(self) -> None:
        """At once and then every minute while nothing is published: where, and how."""
        if self.current is None and artifact.read_current(self.root) is None:
            now = time.monotonic()
            if now - self._told_empty >= EMPTY_ROOT_LOG_S:
                self._told_empty = now
                log.warning("%s", self.publish_hint())

    async def start(self) -> None:
        """The first load, awaited before the worker takes connections: the version CURRENT
        names is opened and warmed up (or refused, and reported), or none is published yet."""
        try:
            await self.refresh()
        except VersionRejected:
            pass
        except Exception:
            log.exception("checking %s for a new version failed", self.root)
        self.heap.settle_if_due()
        self._tell_if_empty()

    async def wait_serving(self, timeout_s: float) -> ServingVersion | None:
        """The version that serves; when none does yet but CURRENT names one that is being
        loaded (a worker that started before it was published, say), up to `timeout_s` for
        it, rather than answering a client that a published version is not there."""
        if self.current is not None:
            return self.current
        version_id = artifact.read_current(self.root)
        if version_id is None or version_id in self.rejected:
            return None
        if artifact.current_problem(self.root, version_id) is not None:
            return None  # nothing to wait for: CURRENT names no version of the root
        try:
            await asyncio.wait_for(self._loaded.wait(), timeout_s)
        except TimeoutError:
            return None
        return self.current

    async def poll_forever(self) -> None:
        while True:
            self._tell_if_empty()
            try:
                await self.probe(max_age_s=0.0)  # a version gone stops serving before the refresh
                await self.refresh()
            except VersionRejected:
                pass
            except Exception:  # the poller must survive anything a bad root throws at it
                log.exception("checking %s for a new version failed", self.root)
            self.heap.settle_if_due()
            await asyncio.sleep(self.settings.poll_interval_s)
