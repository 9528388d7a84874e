"""The search page at `/`, its static files, and (in demo mode) the demo's media and examples.

The page and its static files are open; the demo's media and examples are records' payloads,
so they take the read key when keys are on (app.api.auth), as every route returning records
does."""

from __future__ import annotations

from pathlib import Path

import orjson
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from app.api.auth import ReadKey
from app.api.deps import State
from app.api.docs import errors
from app.api.http import JSONResponse
from app.core.errors import NotFound

STATIC = Path(__file__).resolve().parent.parent / "static"
EXAMPLES = "examples.json"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


@router.get(
    "/v1/demo/examples",
    dependencies=[ReadKey],
    responses=errors(401, 404),
    summary="The demo's held-out examples for the page's pickers (demo mode only)",
)
async def examples(state: State) -> JSONResponse:
    media = state.settings.media_dir
    if media is None or not (media / EXAMPLES).is_file():
        raise NotFound("this service has no demo examples")
    return JSONResponse(orjson.loads((media / EXAMPLES).read_bytes()))


def install(app: FastAPI, media_dir: Path | None) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if media_dir is not None:
        # Only the demo's own generated media: clients never name server paths in queries.
        # Starlette's StaticFiles resolves a path inside its directory; a route around it, not
        # a mount, so that the read key is checked first.
        files = StaticFiles(directory=media_dir)

        async def media(path: str, request: Request) -> Response:
            return await files.get_response(path, request.scope)

        app.add_api_route(
            "/media/{path:path}", media, dependencies=[ReadKey], include_in_schema=False
        )
