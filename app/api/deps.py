"""What handlers receive through Depends: the process's AppState and the served version."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.core.errors import NotReady
from app.services.state import AppState
from app.services.versions import ServingVersion


async def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.hclip
    return state


async def serving_of(state: AppState) -> ServingVersion:
    serving = state.versions.current
    if serving is None:
        serving = await state.versions.wait_serving(state.settings.request_timeout_s)
    if serving is None:
        raise NotReady(state.versions.not_ready())
    return serving


async def get_serving(request: Request) -> ServingVersion:
    # async: FastAPI runs plain-def dependencies on a thread pool, a hop per request.
    return await serving_of(request.app.state.hclip)


State = Annotated[AppState, Depends(get_state)]
Serving = Annotated[ServingVersion, Depends(get_serving)]
