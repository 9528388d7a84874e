"""The FastAPI application: built by create_app(settings); heavy resources live in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import faiss
import threadpoolctl
import torch
from fastapi import FastAPI

from app.api import handlers, ops, page, records, search
from app.api import openapi as api_doc
from app.api.auth import Keys
from app.api.http import JSONResponse
from app.api.middleware import body_limit, request_context, request_metrics
from app.core.metrics import Metrics
from app.core.settings import Settings, get_settings
from app.services.cache import make_cache
from app.services.checks import RequestChecks
from app.services.core_share import CoreShare
from app.services.search import SearchService
from app.services.state import AppState
from app.services.threads import WorkerPools
from app.services.versions import ServingVersion, VersionManager
from app.services.workers import WorkerBoard, exit_with_parent
from indexer.search import ann, exact, lone_query
from models.machine import usable_cores

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # OpenMP counts are per thread: the worker pools set theirs in their own threads. The
        # event loop's thread runs small work (vector encoders), for which waking another
        # thread costs more than it saves.
        torch.set_num_threads(1)
        faiss.omp_set_num_threads(settings.search_threads)
        exact.use_blas_from(settings.faiss_blas_from)
        lone_query.use_threads(settings.lone_query_threads)
        ann.use_rerank_factor(settings.rerank_factor)
        # numpy's and FAISS's OpenBLAS keep a pool of one thread per core, process-wide: held
        # to this worker's share.
        threadpoolctl.threadpool_limits(settings.search_threads, user_api="blas")
        share = None
        if settings.shared_encode_threads:  # a lone encode takes the cores others leave
            share = CoreShare(usable_cores(), settings.encode_threads, settings.workers_dir)
        pools = WorkerPools(settings.search_threads, settings.encode_threads, share)
        cache = make_cache(
            settings.redis_url,
            max_bytes=settings.cache_max_bytes,
            timeout_s=settings.redis_timeout_s,
            retry_s=settings.redis_retry_s,
            metrics=metrics,
            secret=settings.cache_secret,
        )
        board = WorkerBoard(settings.workers_dir, settings.workers, Metrics.worker_exited)
        versions = VersionManager(settings, metrics, pools, board)
        service = SearchService(settings, metrics, cache)
        app.state.hclip = AppState(
            settings, metrics, cache, versions, pools, service, RequestChecks(settings), board
        )
        log.info("index root %s, cache %s", settings.root, cache.backend)
        # The first version is loaded and warmed before the server listens (uvicorn accepts
        # once the lifespan has started), so no worker takes a connection it cannot answer.
        await versions.start()
        tasks = [asyncio.create_task(versions.poll_forever())]
        if settings.workers_dir is not None:  # a worker of `hclip serve --workers N`
            tasks.append(asyncio.create_task(exit_with_parent()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            versions.heap.thaw()
            board.leave()
            await cache.close()
            pools.shutdown()
            metrics.worker_exited()

    app = FastAPI(
        title="H-CLIP retrieval",
        version="0.1.0",
        description="Search records of several modalities with a Hadamard-CLIP model. Errors "
        "are {error, error_type, request_id}; see docs/design.md in the repository.",
        lifespan=lifespan,
        default_response_class=JSONResponse,
    )
    app.state.keys = Keys.of(settings)  # read keys, checked by the routes before their bodies
    handlers.install(app)
    app.add_middleware(
        body_limit,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(request_metrics, metrics=metrics)
    instance = settings.instance or f"{socket.gethostname()}-{os.getpid()}"
    # outermost: every response gets its request id, the instance that answered it and where
    # its time went
    app.add_middleware(request_context, instance=instance, server_timing=settings.server_timing)
    # Routes are matched in order: the search routes, the busiest, come first.
    search.install(app)
    for module in (ops, records):
        app.include_router(module.router)
    page.install(app, settings.media_dir)
    api_doc.install(app, settings, lambda: _current(app))
    return app


def _current(app: FastAPI) -> ServingVersion | None:
    state: AppState | None = getattr(app.state, "hclip", None)
    return state.versions.current if state is not None else None
