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
from starlette.types import Receive, Scope, Send

from app.api import handlers, ops, page, records, search
from app.api import openapi as api_doc
from app.api.auth import Keys
from app.api.fastpath import SearchFastPath, is_fast_path
from app.api.http import ApiRoute, JSONResponse
from app.api.middleware import BodyLimitMiddleware, MetricsMiddleware, RequestContextMiddleware
from app.core.metrics import Metrics
from app.core.settings import Settings, get_settings, machine_cores
from app.services.cache import make_cache
from app.services.idle_cores import SearchLoad
from app.services.search import SearchService
from app.services.state import AppState
from app.services.threads import WorkerPools
from app.services.versions import ServingVersion, VersionManager

log = logging.getLogger(__name__)


class App(FastAPI):
    """FastAPI, with POST /v1/search taken before the framework's own layers (its telemetry,
    error and body-limit middlewares, routing): see app/api/fastpath.py."""

    fast_path: SearchFastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fast_path is not None and is_fast_path(scope):
            scope["app"] = self
            await self.fast_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request through the whole FastAPI stack (what the fast path hands on)."""
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # OpenMP counts are per thread: the worker pools set theirs in their own threads. The
        # event loop's thread runs small work (vector encoders, lone searches on the loop), for
        # which waking another thread under the passive wait policy costs more than it saves.
        torch.set_num_threads(1)
        faiss.omp_set_num_threads(settings.search_threads)
        # numpy's OpenBLAS keeps a pool of one thread per core, process-wide: held to a share.
        threadpoolctl.threadpool_limits(settings.search_threads, user_api="blas")
        pools = WorkerPools(settings.search_threads, settings.encode_threads)
        cache = make_cache(
            settings.redis_url,
            max_items=settings.cache_max_items,
            timeout_s=settings.redis_timeout_s,
            retry_s=settings.redis_retry_s,
            metrics=metrics,
            secret=settings.cache_secret,
        )
        load = SearchLoad(machine_cores())
        versions = VersionManager(settings, metrics, pools, load)
        service = SearchService(settings, metrics, cache, load)
        app.state.hclip = AppState(settings, metrics, cache, versions, pools, service)
        log.info("index root %s, cache %s", settings.root, cache.backend)
        # The first version is loaded and warmed before the server listens (uvicorn binds once
        # the lifespan has started), so no worker takes a connection it cannot answer.
        await versions.start()
        poller = asyncio.create_task(versions.poll_forever())
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await cache.close()
            pools.shutdown()
            metrics.worker_exited()

    app = App(
        title="H-CLIP retrieval",
        version="0.1.0",
        description="Search records of several modalities with a Hadamard-CLIP model. Errors "
        "are {error, error_type, request_id}; see docs/design.md in the repository.",
        lifespan=lifespan,
        default_response_class=JSONResponse,
    )
    app.router.route_class = ApiRoute
    app.state.keys = Keys.of(settings)  # read keys, checked by the routes and the fast path
    handlers.install(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    instance = settings.instance or f"{socket.gethostname()}-{os.getpid()}"
    # outermost: every response gets its request id and the instance that answered it
    app.add_middleware(RequestContextMiddleware, instance=instance)
    # In front of the whole stack: the search route's own path past the framework.
    app.fast_path = SearchFastPath(
        app.routed, metrics=metrics, instance=instance, max_body_bytes=settings.max_body_bytes
    )
    # Routes are matched in order: the search routes, the busiest, come first.
    for module in (search, ops, records):
        app.include_router(module.router)
    page.install(app, settings.media_dir)
    api_doc.install(app, settings, lambda: _current(app))
    return app


def _current(app: FastAPI) -> ServingVersion | None:
    state: AppState | None = getattr(app.state, "hclip", None)
    return state.versions.current if state is not None else None
