"""HTTP plumbing: request bodies parsed with orjson behind limits on nesting depth, object
members and values, and orjson responses.

Request bodies:

orjson is several times faster than the standard library on bodies of floats, and it refuses
what is not JSON (NaN, Infinity, lone surrogates, numbers beyond a double) where the standard
library lets some through. The limits are checked on the raw bytes before parsing, so that no
body costs more than its size to refuse: counts of brackets, colons and commas bound the
depth, the members and the values, so ordinary bodies cost a few C-speed scans; only a body
over a bound gets the exact measure (the same characters outside strings, found with numpy).
A large body is parsed on a thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse as StarletteJSONResponse

from app.core.settings import Settings

OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed on a thread


@dataclass(frozen=True)
class JsonLimits:
    depth: int = 32  # nesting of [ and {
    members: int = 10_000  # object members, in all the body's objects
    values: int = 1_000_000  # comma-separated values: array items and object members


def limits_of(settings: Settings) -> JsonLimits:
    return JsonLimits(settings.max_json_depth, settings.max_json_members, settings.max_json_values)


def outside_strings(body: bytes) -> np.ndarray:
    """The body's bytes that lie outside JSON strings (as uint8; the rest zeroed)."""
    raw = np.frombuffer(body, dtype=np.uint8)
    quote = raw == ord('"')
    backslash = raw == ord("\\")
    if backslash.any():  # a quote after an odd run of backslashes is part of a string
        where = np.arange(raw.size)
        last_other = np.maximum.accumulate(np.where(backslash, -1, where))
        q = np.flatnonzero(quote)
        q = q[q > 0]
        escaped = ((q - 1) - last_other[q - 1]) % 2 == 1
        quote[q[escaped]] = False
    inside = np.cumsum(quote, dtype=np.int64) % 2 == 1
    return np.where(inside, 0, raw).astype(np.uint8)


def json_depth(body: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text (brackets inside strings do not count)."""
    if body.count(b"[") + body.count(b"{") <= 1:
        return int(b"[" in body or b"{" in body)
    raw = outside_strings(body)
    step = (raw == ord("[")).astype(np.int32) + (raw == ord("{"))
    step -= (raw == ord("]")).astype(np.int32) + (raw == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _over(body: bytes, char: bytes, limit: int) -> bool:
    """More than `limit` of `char` outside strings (the raw count first: it bounds that)."""
    return body.count(char) > limit and int((outside_strings(body) == char[0]).sum()) > limit


def parse_json(body: bytes, limits: JsonLimits) -> Any:
    """orjson's parse, after the limits; failures raise json.JSONDecodeError, which FastAPI
    answers as a 422."""
    if body.count(b"[") + body.count(b"{") > limits.depth and json_depth(body) > limits.depth:
        raise json.JSONDecodeError(
            f"nested deeper than {limits.depth} levels (HCLIP_MAX_JSON_DEPTH)", "", 0
        )
    if _over(body, b":", limits.members):
        raise json.JSONDecodeError(
            f"more than {limits.members} object members (HCLIP_MAX_JSON_MEMBERS)", "", 0
        )
    if _over(body, b",", limits.values - 1):
        raise json.JSONDecodeError(
            f"more than {limits.values} values in arrays and objects (HCLIP_MAX_JSON_VALUES)",
            "",
            0,
        )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise json.JSONDecodeError(exc.msg, "", exc.pos) from None


async def parse_json_async(body: bytes, limits: JsonLimits) -> Any:
    """parse_json, on a thread for a large body: the event loop goes on serving meanwhile."""
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, body, limits)
    return parse_json(body, limits)


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            hclip = getattr(self.app.state, "hclip", None)
            limits = limits_of(hclip.settings) if hclip is not None else JsonLimits()
            self._json = await parse_json_async(await self.body(), limits)
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
