"""The loaded version and its hot swap.

A request takes the ServingVersion that is current when it starts and uses it to the end, so
it finishes on the old version even if a new one is swapped in meanwhile; the old version's
memory maps close when the last such request lets go of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.batching import MicroBatcher, SearchItem, SearchResult, encode_batcher, search_batcher
from app.errors import VersionRejected
from app.metrics import Metrics
from app.settings import Settings
from app.workers import WorkerPools
from indexer import artifact
from indexer.flat import HALVES_MIN_ROWS, Router
from indexer.reader import LoadedVersion, View
from indexer.verify import verify_contents, verify_files
from models.checkpoint import fingerprint, load_model
from models.heads import HClipHead
from models.model import MultimodalModel

log = logging.getLogger(__name__)


def open_checked(vdir: Path, level: str) -> LoadedVersion:
    """Open a version for serving after the checks `level` asks for (see indexer.verify):
    "quick" costs the same whatever the record count, "full" reads and recomputes it all."""
    version_id = vdir.name
    problems = verify_files(vdir, full=level == "full") if level != "off" else []
    if problems:
        raise VersionRejected(f"version {version_id} failed verification: {problems[0]}")
    try:
        index = LoadedVersion(vdir)
    except (artifact.ArtifactError, OSError, RuntimeError, ValueError, KeyError) as exc:
        raise VersionRejected(f"version {version_id} cannot be opened: {exc}") from None
    problems = verify_contents(vdir) if level == "full" else []
    if problems:
        raise VersionRejected(f"version {version_id} failed verification: {problems[0]}")
    return index


@dataclass
class ServingVersion:
    index: LoadedVersion
    model: MultimodalModel
    searchers: dict[str, MicroBatcher[SearchItem, SearchResult]] = field(
        default_factory=dict
    )  # one per view
    encoders: dict[str, MicroBatcher[Any, np.ndarray]] = field(default_factory=dict)
    # H-CLIP's and Symile's omega, taken once: their query factor is then omega times the
    # Hadamard product, in numpy, the same float32 products torch makes (docs/design.md §1),
    # without torch's dispatch per request (measured: 10 us warm, 150 us once a scan has
    # evicted torch from the cache). None for the heads whose factor is more than that.
    omega: np.ndarray | None = None

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint


def _log_failure(job: Future[None]) -> None:
    exc = job.exception()
    if exc is not None:
        log.error("measuring the search kernels failed; the default rule stays", exc_info=exc)


@dataclass
class Rejection:
    """A version that could not be loaded, and when the poller will try it again."""

    reason: str
    attempts: int
    retry_at: float  # time.monotonic()


class VersionManager:
    """Loads the version CURRENT names and swaps it in; retries a rejected one with backoff,
    since what failed may be transient (a model volume not mounted yet, a disk hiccup)."""

    def __init__(self, settings: Settings, metrics: Metrics, pools: WorkerPools):
        self.settings = settings
        self.root = Path(settings.root)
        self.metrics = metrics
        self.pools = pools
        self.current: ServingVersion | None = None
        self.rejected: dict[str, Rejection] = {}
        self._models: dict[str, MultimodalModel] = {}
        self._lock = asyncio.Lock()
        self._blas_threshold_set = False
        self.routers: dict[int, Router] = {}  # vector width -> exact kernels by batch size
        # Searches between their checks and their answer, in this process (app.routes.search
        # counts them): one alone may use both cores.
        self.searches_in_flight = 0
        self._cores = len(os.sched_getaffinity(0))
        on = settings.search_on_loop
        self._search_on_loop = on == "on" or (on == "auto" and settings.workers >= self._cores)
        self._calibrations: list[Future[None]] = []  # kernel measurements queued or running

    def _open(self, version_id: str) -> ServingVersion:
        """Blocking: check and open a version, load (or reuse) its model, build its workers."""
        index = open_checked(
            artifact.version_dir(self.root, version_id), self.settings.verify_on_load
        )
        model = self._model_for(index)
        return self._serving(index, model)

    def _model_for(self, index: LoadedVersion) -> MultimodalModel:
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
            model = load_model(model_dir)
        except (OSError, ValueError) as exc:
            raise VersionRejected(f"model of version {index.version}: {exc}") from None
        self._models = {index.fingerprint: model}  # keep only the model in use
        return model

    def _router(self, dim: int) -> Router:
        """The exact kernels' router for vectors of `dim`, measured on first use. The work is
        queued on the FAISS thread, so that it never runs beside a search (the first
        measurement sets FAISS's process-wide BLAS threshold, once), and is not waited for:
        the version serves at once, with the router's default rule until the table is in."""
        router = self.routers.get(dim)
        if router is None:
            router = Router()
            first = not self._blas_threshold_set
            if self.settings.calibrate_kernels:
                job = self.pools.faiss.submit(router.calibrate, dim, set_threshold=first)
                job.add_done_callback(_log_failure)
                self._calibrations.append(job)
            elif first:
                self.pools.faiss.submit(router.keep_faiss_scanning)
            self._blas_threshold_set = True
            self.routers[dim] = router
        return router

    def _splits(self, router: Router | None, view: View) -> Callable[[], bool]:
        """Whether a search now has this process to itself and may scan `view` on two
        threads (indexer.flat.faiss_halves): when allowed, with two cores to use, on an exact
        view large enough to gain from it."""
        large = view.vectors is not None and view.vectors.shape[0] >= HALVES_MIN_ROWS
        if router is None or not large or not self.settings.split_lone_search or self._cores < 2:
            return lambda: False
        return lambda: self.searches_in_flight <= 1

    def _on_loop(self) -> Callable[[], bool]:
        """Whether a batch now runs on the event loop rather than the FAISS thread: when
        search_on_loop says so, once no kernel measurement is queued or running on that thread
        (a measurement sets FAISS's process-wide BLAS threshold, so no search runs beside it).

        Measured with two workers on two cores, 32 connections: each worker's batches ran on
        its own loop at 0.76-1.29 CPU-ms a query against 1.03-2.32 through the thread, in
        alternating runs, with larger batches (a batch gathers every request that arrived
        during the previous one, since nothing else competes for the worker's core)."""
        if not self._search_on_loop:
            return lambda: False

        def on_loop() -> bool:
            if self._calibrations:
                self._calibrations = [job for job in self._calibrations if not job.done()]
            return not self._calibrations

        return on_loop

    def _kernels(self, router: Router | None, alone: Callable[[], bool]) -> Callable[[int], str]:
        """Batch size -> exact kernel: the router's choice, except for a search alone."""
        if router is None:
            return lambda n: "faiss"

        def kernel_for(n: int) -> str:
            return "faiss_halves" if n == 1 and alone() else router.kernel_for(n)

        return kernel_for

    def _serving(self, index: LoadedVersion, model: MultimodalModel) -> ServingVersion:
        s = self.settings
        serving = ServingVersion(index, model)
        head = model.head
        if isinstance(head, HClipHead):  # Symile is one too, with omega's direction fixed
            serving.omega = head.omega.detach().numpy().astype(np.float32)
        wait_s = s.batch_wait_ms / 1000.0
        for name, view in index.views.items():
            router = self._router(view.dim) if view.vectors is not None else None
            alone = self._splits(router, view)
            serving.searchers[name] = search_batcher(
                view, self.pools.faiss, s.batch_max, wait_s, self.metrics.batch_size.observe,
                s.max_pending, self._kernels(router, alone), index.mask_of, alone,
                self._on_loop(),
            )  # fmt: skip
        limits = s.input_limits()
        for name in model.names:
            serving.encoders[name] = encode_batcher(
                model, name, self.pools.encoder(name), s.batch_max, wait_s, limits, s.max_pending,
                self.metrics.encode_batch_size.labels(name).observe,
            )  # fmt: skip
        return serving

    def _reject(self, version_id: str, reason: str) -> Rejection:
        previous = self.rejected.get(version_id)
        attempts = previous.attempts + 1 if previous else 1
        s = self.settings
        delay = min(s.reload_retry_max_s, s.reload_retry_s * 2 ** (attempts - 1))
        rejection = Rejection(reason, attempts, time.monotonic() + delay)
        self.rejected[version_id] = rejection
        self.metrics.reloads.labels(outcome="rejected").inc()
        self.metrics.rejected_versions.set(len(self.rejected))
        log.error(
            "%s; still serving %s; trying again in %.0f s (attempt %d)",
            reason,
            self.current.version if self.current else "nothing",
            delay,
            attempts,
        )
        return rejection

    async def refresh(self, force: bool = False) -> bool:
        """Load the version CURRENT names if it is new; True when a swap happened. A version
        rejected before is tried again once its backoff has passed (at once when forced)."""
        async with self._lock:
            version_id = artifact.read_current(self.root)
            if version_id is None:
                return False
            if self.current is not None and self.current.version == version_id:
                return False
            rejected = self.rejected.get(version_id)
            if rejected is not None and not force and time.monotonic() < rejected.retry_at:
                return False
            t0 = time.perf_counter()
            try:
                serving = await asyncio.get_running_loop().run_in_executor(
                    None, self._open, version_id
                )
            except VersionRejected as exc:
                self._reject(version_id, exc.message)
                raise
            took = time.perf_counter() - t0
            self.metrics.load_seconds.set(took)
            old = self.current
            self.current = serving
            # A version CURRENT no longer names will not be tried again.
            self.rejected.clear()
            self.metrics.rejected_versions.set(0)
            self.metrics.set_version(version_id)
            self.metrics.reloads.labels(outcome="loaded").inc()
            log.info(
                "serving version %s (was %s), opened in %.3f s",
                version_id,
                old.version if old else "none",
                took,
            )
            return True

    async def poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except VersionRejected:
                pass
            except Exception:  # the poller must survive anything a bad root throws at it
                log.exception("checking %s for a new version failed", self.root)
            await asyncio.sleep(self.settings.poll_interval_s)
