"""Where a request's time went, for its `Server-Timing` response header (W3C Server Timing):
browsers' developer tools draw it, and a client reads it to tell the tower's time from the
queue's and the network's.

The outermost middleware starts a request's `Stages` (`begin`); the batchers add to it what
they did for the request (`record`), from the request's own task or any task it started
(contextvars are copied into them, the `Stages` with them), and the middleware writes the
header when the response starts. A stage met more than once (the queries of a batch, two raw
inputs encoded at once) keeps its longest time: they overlap, so the longest is what the
request waited.
"""

from __future__ import annotations

import functools
import time
from contextvars import ContextVar, Token

_CURRENT: ContextVar[Stages | None] = ContextVar("hclip_request_stages", default=None)


class Stages:
    """A request's stages: metric name and description -> the longest time (s), and the size
    of the batch that took it."""

    __slots__ = ("_spans", "started")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self._spans: dict[tuple[str, str], tuple[float, int]] = {}

    def add(self, metric: str, desc: str, seconds: float, batch: int = 0) -> None:
        key = (metric, desc)
        was = self._spans.get(key)
        if was is None or seconds > was[0]:
            self._spans[key] = (seconds, batch)

    def header(self) -> bytes:
        """`metric;dur=ms;desc="..."` for each stage, then `total`: the time since `begin`."""
        parts = []
        for (metric, desc), (seconds, batch) in self._spans.items():
            about = f"{desc} (batch of {batch})" if batch else desc
            parts.append(f'{metric};dur={1e3 * seconds:.2f};desc="{_quoted(about)}"')
        parts.append(f"total;dur={1e3 * (time.perf_counter() - self.started):.2f}")
        return ", ".join(parts).encode("ascii")


@functools.lru_cache(maxsize=256)  # the descriptions are the modalities' and views' names
def _quoted(text: str) -> str:
    """A description as a header's quoted-string holds it: ASCII, no quote or backslash."""
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "?" for c in text)


def begin() -> tuple[Stages, Token[Stages | None]]:
    """A new request's stages, current in this task and the tasks it starts."""
    stages = Stages()
    return stages, _CURRENT.set(stages)


def end(token: Token[Stages | None]) -> None:
    _CURRENT.reset(token)


def record(metric: str, desc: str, seconds: float, batch: int = 0) -> None:
    """Adds a stage to the current request's (nothing outside a request)."""
    stages = _CURRENT.get()
    if stages is not None:
        stages.add(metric, desc, seconds, batch)
