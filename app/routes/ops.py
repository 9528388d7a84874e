"""Health, readiness, info, metrics and the admin reload."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header
from starlette.responses import Response

from app.errors import NotReady, Unauthorized
from app.responses import JSONResponse
from app.state import Serving, State

router = APIRouter()


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(state: State) -> JSONResponse:
    current = state.versions.current
    if current is None:
        raise NotReady("no index version is loaded yet")
    return JSONResponse({"status": "ready", "index_version": current.version})


@router.get("/v1/info")
async def info(state: State, serving: Serving) -> JSONResponse:
    m = serving.index.manifest
    model = serving.model
    return JSONResponse(
        {
            "model": {
                "fingerprint": serving.fingerprint,
                "head": model.cfg.head,
                "modalities": {n: model.cfg.modalities[n].kind for n in model.names},
                "d": model.cfg.latent_dim,
                **model.head.public_params(),
            },
            "index_version": serving.version,
            "parent_version": m.get("parent"),
            "created": m.get("created"),
            "views": {
                name: {k: v[k] for k in ("query", "target", "count", "spec", "recall_at_10")}
                for name, v in m["views"].items()
            },
            "counts": m["counts"],
            "cache": state.cache.backend,
        }
    )


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/v1/admin/reload")
async def reload(
    state: State, authorization: Annotated[str | None, Header()] = None
) -> JSONResponse:
    token = state.settings.admin_token
    presented = (authorization or "").removeprefix("Bearer ").strip()
    if not token or not authorization or not hmac.compare_digest(presented, token):
        raise Unauthorized("admin endpoints need 'Authorization: Bearer <HCLIP_ADMIN_TOKEN>'")
    changed = await state.versions.refresh(force=True)
    current = state.versions.current
    return JSONResponse(
        {
            "changed": changed,
            "index_version": current.version if current else None,
        }
    )
