"""HTTP plumbing: request bodies parsed with orjson behind a nesting-depth limit, and orjson
responses.

Request bodies:

orjson is several times faster than the standard library on bodies of floats, and it refuses
what is not JSON (NaN, Infinity, lone surrogates, numbers beyond a double) where the standard
library lets some through. Depth is checked on the raw bytes before parsing: the count of
brackets bounds it, so ordinary bodies cost two C-speed scans; only a body with many brackets
gets the exact measure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse as StarletteJSONResponse

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
DEFAULT_MAX_DEPTH = 32


def json_depth(body: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text (brackets inside strings do not count)."""
    if body.count(b"[") + body.count(b"{") <= 1:
        return int(b"[" in body or b"{" in body)
    raw = np.frombuffer(_STRING.sub(b'""', body), dtype=np.uint8)
    step = (raw == ord("[")).astype(np.int32) + (raw == ord("{"))
    step -= (raw == ord("]")).astype(np.int32) + (raw == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def parse_json(body: bytes, max_depth: int) -> Any:
    """orjson's parse; failures raise json.JSONDecodeError, which FastAPI answers as a 422."""
    if body.count(b"[") + body.count(b"{") > max_depth and json_depth(body) > max_depth:
        raise json.JSONDecodeError(
            f"nested deeper than {max_depth} levels (HCLIP_MAX_JSON_DEPTH)", "", 0
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise json.JSONDecodeError(exc.msg, "", exc.pos) from None


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            hclip = getattr(self.app.state, "hclip", None)
            depth = hclip.settings.max_json_depth if hclip is not None else DEFAULT_MAX_DEPTH
            self._json = parse_json(await self.body(), depth)
        return self._json


class ApiRoute(APIRoute):
    """Every route of the API reads its body through OrjsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_with_orjson(request: Request) -> Response:
            return await handler(OrjsonRequest(request.scope, request.receive))

        return parse_with_orjson


# orjson responses: the default JSON encoder halves FastAPI's throughput on result lists. A
# subclass of Starlette's JSONResponse, so that FastAPI documents each route's response model.
class JSONResponse(StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
