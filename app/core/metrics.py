"""Prometheus metrics, in a registry per app so that tests can run several apps side by side.

Under `hclip serve --workers N` every worker is a process of its own: prometheus-client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the command before any worker starts) keeps
each worker's values in a shared directory, and /metrics, whichever worker answers it, renders
the whole: counters and histograms summed over workers, gauges per live worker (a `pid` label).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hclip_requests_total", "HTTP requests", ["endpoint", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "hclip_request_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache = Counter("hclip_cache_total", "cache lookups", ["kind", "outcome"], registry=r)
        self.result_hits = self.cache.labels(kind="result", outcome="hit")
        self.result_misses = self.cache.labels(kind="result", outcome="miss")
        self.cache_errors = Counter(
            "hclip_cache_errors_total", "cache backend failures (Redis down or slow)", registry=r
        )
        self.cache_rejected = Counter(
            "hclip_cache_rejected_total",
            "cache entries that failed their integrity check (answered as misses)",
            registry=r,
        )
        self.batch_size = Histogram(
            "hclip_search_batch_size",
            "queries per FAISS call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.encode_batch_size = Histogram(
            "hclip_encode_batch_size",
            "raw inputs per encoder call",
            ["modality"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.version = Gauge(
            "hclip_index_version_info",
            "the loaded index version (value 1; under --workers, a version left reads 0)",
            ["version"],
            registry=r,
            multiprocess_mode="liveall",
        )
        self._loaded: str | None = None  # the version set to 1 last
        self.reloads = Counter("hclip_reloads_total", "version loads", ["outcome"], registry=r)
        self.load_seconds = Gauge(
            "hclip_version_load_seconds",
            "how long opening the last loaded version took",
            registry=r,
            multiprocess_mode="liveall",
        )
        self.rejected_versions = Gauge(
            "hclip_rejected_versions",
            "versions CURRENT named that could not be loaded (retried with backoff)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.overloaded = Counter(
            "hclip_overloaded_total",
            "requests refused with 503: a full queue or a passed deadline",
            ["reason"],
            registry=r,
        )

    def set_version(self, version: str) -> None:
        if multiprocess():
            # Each worker's values live in the shared directory's files, which clear() does
            # not touch (prometheus-client keeps them): the version this worker leaves reads 0,
            # or /metrics would go on reporting it as loaded beside the new one.
            # (The files keep every label a worker has set: one series per version it loaded.)
            if self._loaded is not None and self._loaded != version:
                self.version.labels(version=self._loaded).set(0)
        else:
            self.version.clear()
        self.version.labels(version=version).set(1)
        self._loaded = version

    def render(self) -> bytes:
        if multiprocess():
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)

    @staticmethod
    def worker_exited(pid: int | None = None) -> None:
        """Drop a worker's live gauges from the shared directory: this one's at a clean exit,
        or a dead sibling's (app.services.workers)."""
        if multiprocess():
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(os.getpid() if pid is None else pid)
