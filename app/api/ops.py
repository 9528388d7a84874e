"""Health, readiness, info, metrics and the admin reload."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.auth import MetricsKey, ReadKey, admin_token_matches
from app.api.deps import Serving, State
from app.api.docs import errors
from app.api.http import JSONResponse
from app.api.schemas import Health, InfoResponse, Ready, ReloadResponse
from app.core.errors import NotReady, Unauthorized
from app.services.state import AppState

router = APIRouter()


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    response_model=Ready,
    responses=errors(503),
    summary="Readiness: every worker serves a version that can answer",
)
async def readyz(state: State) -> JSONResponse:
    # Ready means every worker serves a version that can answer now: no waiting for one here.
    versions = state.versions
    problem = await versions.probe()  # cached a second: /readyz stays cheap
    current = versions.current
    if current is None:
        raise NotReady(versions.not_ready())
    if problem is not None:
        raise NotReady(problem)
    others = state.workers.not_ready()
    if others is not None:
        raise NotReady(others)
    body: dict[str, Any] = {"status": "ready", "index_version": current.version}
    warning = versions.warning()
    if warning is not None:  # CURRENT names no version: another serves meanwhile
        body["warning"] = warning
    return JSONResponse(body)


def _rejected(state: AppState) -> list[dict[str, object]]:
    now = time.monotonic()
    return [
        {
            "version": version,
            "reason": r.reason,
            "attempts": r.attempts,
            "next_retry_in_s": None if r.files else round(max(0.0, r.retry_at - now), 3),
        }
        for version, r in state.versions.rejected.items()
    ]


def _view_info(entry: dict[str, Any]) -> dict[str, Any]:
    out = {k: entry[k] for k in ("query", "target", "count", "spec", "recall_at_10")}
    tuning = entry.get("tuning")
    if tuning is not None:  # what the tuner compared when it picked (indexer.tune.tuner)
        out["tuning"] = {
            k: tuning[k] for k in ("picked", "served_batch", "check", "flat", "why") if k in tuning
        }
    if "stores" in entry:  # a compact version's view (indexer.build.compact)
        out["stores"] = entry["stores"]
    if "milvus" in entry:  # a view held in Milvus (indexer.store.milvus_served.served_manifest)
        out["milvus"] = entry["milvus"]
    return out


@router.get(
    "/v1/info",
    response_model=InfoResponse,
    responses=errors(401, 503),
    dependencies=[ReadKey],
    summary="The model, the loaded index version, its views and counts",
)
async def info(state: State, serving: Serving) -> JSONResponse:
    m = serving.index.manifest
    model = serving.model
    return JSONResponse(
        {
            "model": {
                "fingerprint": serving.fingerprint,
                "head": model.cfg.head,
                "modalities": {n: model.cfg.modalities[n].kind for n in model.names},
                "inputs": {n: model.cfg.modalities[n].raw_form for n in model.names},
                "d": model.cfg.latent_dim,
                **model.head.public_params(),
            },
            "index_version": serving.version,
            "parent_version": m.get("parent"),
            "created": m.get("created"),
            "views": {name: _view_info(v) for name, v in m["views"].items()},
            "counts": m["counts"],
            "backend": (m.get("backend") or {}).get("kind", "faiss"),
            "cache": state.cache.backend,
            "rejected_versions": _rejected(state),
        }
    )


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=[MetricsKey],
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics, text format",
)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post(
    "/v1/admin/reload",
    response_model=ReloadResponse,
    responses=errors(401, 409),
    summary="Load the version CURRENT names now (a rejected one is retried at once)",
)
async def reload(request: Request, state: State) -> JSONResponse:
    if not admin_token_matches(request, state.settings.admin_token):
        raise Unauthorized("admin endpoints need 'Authorization: Bearer <HCLIP_ADMIN_TOKEN>'")
    changed = await state.versions.refresh(force=True)
    current = state.versions.current
    return JSONResponse(
        {
            "changed": changed,
            "index_version": current.version if current else None,
        }
    )
