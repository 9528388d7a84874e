"""What handlers receive: the process's AppState and the served version, through Depends; and,
for the search routes, the same in one call (`search_inputs`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from app.api.auth import read_key
from app.core.errors import NotReady
from app.services.state import AppState
from app.services.versions import ServingVersion

M = TypeVar("M", bound=BaseModel)


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


async def search_inputs(
    request: Request, parse: Callable[[Request], Awaitable[M]]
) -> tuple[M, AppState, ServingVersion]:
    """A search route's inputs, in the order its dependencies would give them: the read key
    checked, then the body read and parsed, then the served version. Called by the route, not
    through Depends: solving them was the largest single cost in a profile of the event loop
    serving searches (docs/benchmarks/tower_serving.md)."""
    await read_key(request)
    body = await parse(request)
    state = await get_state(request)
    return body, state, await serving_of(state)
