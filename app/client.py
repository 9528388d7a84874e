"""A Python client for the search service, synchronous and asynchronous, on httpx.

    from app.client import Client

    with Client("http://127.0.0.1:8000") as hclip:
        hits = hclip.search({"image": "cat.png", "text": "on a sofa"}, k=5).hits
        hits = hclip.search(embeddings={"audio": my_vector}, filter={"year": {"gte": 2020}}).hits

Raw inputs go in as Python values and are sent as the API wants them, by the kind of their
modality (learned once from GET /v1/info): a text as a string; an image as a path, bytes, a PIL
image or an (H, W[, C]) array; audio as a path, WAV bytes or a (samples, sample rate) pair; a
vector or embedding as any sequence or array of numbers. A 503 (not ready, overloaded, past
the deadline) and a dropped connection are retried, waiting what Retry-After says (or backing
off); every other error raises HclipError with the server's status, type, message and request
id. `AsyncClient` has the same methods, awaitable.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import re
import time
import wave
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import numpy as np

RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
MEDIA = {"image": "image/png", "audio": "audio/wav"}


class HclipError(Exception):
    """An error answered by the service (or the client's own, status 0)."""

    def __init__(self, status: int, error_type: str, message: str, request_id: str | None = None):
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.error_type = error_type
        self.message = message
        self.request_id = request_id


class HclipTimeout(HclipError, TimeoutError):
    """No answer within the client's timeout."""


@dataclass(frozen=True)
class Hit:
    id: str
    score: float
    payload: dict[str, Any]


@dataclass(frozen=True)
class SearchResult:
    """`timing` (search() only): ms per stage as the server timed it, from its Server-Timing
    header: `total`, and for each raw input's encode and the view's search the wait for its
    call and the call (`encode-wait text`, `encode text`, `search-wait image+text`, `search
    image+text`), within a raw input's encode call its decode and the model's forward
    (`decode text`, `forward text`); empty where the server sends none."""

    index_version: str
    view: str
    hits: list[Hit]
    cached: bool
    effort: int | None = None
    timing: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def from_json(obj: Mapping[str, Any], timing: dict[str, float] | None = None) -> SearchResult:
        hits = [Hit(h["id"], float(h["score"]), h["payload"]) for h in obj["results"]]
        return SearchResult(
            obj["index_version"], obj["view"], hits, obj["cached"], obj.get("effort"),
            timing or {},
        )  # fmt: skip


_STAGE = re.compile(r'([\w-]+);dur=([0-9.]+)(?:;desc="([^"]*)")?')


def server_timing(header: str | None) -> dict[str, float]:
    """A Server-Timing header as {"metric name": ms}: a stage's name is its description
    without the batch the server adds ("text (batch of 4)" -> "text")."""
    out = {}
    for metric, ms, desc in _STAGE.findall(header or ""):
        name = desc.split(" (", 1)[0]
        out[f"{metric} {name}" if name else metric] = float(ms)
    return out


@dataclass(frozen=True)
class Record:
    id: str
    payload: dict[str, Any]
    modalities: list[str]
    index_version: str


@dataclass(frozen=True)
class RecordEmbeddings:
    id: str
    index_version: str
    model_fingerprint: str
    embeddings: dict[str, np.ndarray]  # modality -> (d,)


@dataclass(frozen=True)
class Info:
    raw: dict[str, Any]

    @property
    def modalities(self) -> dict[str, str]:
        """modality -> encoder kind"""
        return dict(self.raw["model"]["modalities"])

    @property
    def inputs(self) -> dict[str, str]:
        """modality -> what a query gives it: image, audio, text, vector or embedding (a
        `transformers` tower's input kind; servers before this field: the encoder kind)"""
        return dict(self.raw["model"].get("inputs") or self.modalities)

    @property
    def d(self) -> int:
        return int(self.raw["model"]["d"])

    @property
    def omega(self) -> np.ndarray | None:
        omega = self.raw["model"].get("omega")
        return None if omega is None else np.asarray(omega, dtype=np.float32)

    @property
    def index_version(self) -> str:
        return str(self.raw["index_version"])


# --- raw inputs -------------------------------------------------------------------------------


def _data_uri(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode("ascii")


def _png(value: Any) -> bytes:
    from PIL import Image

    if not isinstance(value, Image.Image):
        arr = np.asarray(value)
        if arr.dtype != np.uint8:  # floats in [0, 1]
            arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
        value = Image.fromarray(arr)
    buf = io.BytesIO()
    value.save(buf, "PNG")
    return buf.getvalue()


def _wav(samples: Any, rate: int) -> bytes:
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError("audio samples must be one channel: a 1-D array")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes((np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def to_raw(value: Any, kind: str) -> str | list[float]:
    """A Python value as the API's raw input for a modality of this kind."""
    if kind == "text":
        if not isinstance(value, str):
            raise TypeError(f"a text modality takes a str, got {type(value).__name__}")
        return value
    if kind in MEDIA:
        if isinstance(value, str) and value.startswith("data:"):
            return value
        if isinstance(value, str | Path):
            return _data_uri(MEDIA[kind], Path(value).read_bytes())
        if isinstance(value, bytes | bytearray):
            return _data_uri(MEDIA[kind], bytes(value))
        if kind == "audio":
            if isinstance(value, tuple) and len(value) == 2:
                return _data_uri("audio/wav", _wav(*value))
            raise TypeError("audio takes a path, WAV bytes or a (samples, sample rate) pair")
        return _data_uri("image/png", _png(value))
    if isinstance(value, str):
        return value  # a kind of a plugin's: its own raw form
    return np.asarray(value, dtype=np.float64).ravel().tolist()


def _numbers(value: Any) -> list[float]:
    return np.asarray(value, dtype=np.float64).ravel().tolist()


# --- requests and retries, once for both clients (no I/O) --------------------------------------


def _error(r: httpx.Response) -> HclipError:
    try:
        body = r.json()
        return HclipError(r.status_code, body["error_type"], body["error"], body.get("request_id"))
    except (ValueError, KeyError, TypeError):
        return HclipError(r.status_code, "http_error", r.text[:200])


def _wait_s(r: httpx.Response | None, attempt: int, backoff_s: float, max_wait_s: float) -> float:
    if r is not None and r.headers.get("retry-after", "").isdigit():
        return min(max_wait_s, float(r.headers["retry-after"]))
    return min(max_wait_s, backoff_s * 2**attempt * (0.5 + random.random()))


def _search_body(
    query: Mapping[str, Any] | None,
    embeddings: Mapping[str, Any] | None,
    k: int | None,
    filter: Mapping[str, Any] | None,
    effort: int | None,
    kinds: Mapping[str, str],
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if query:
        body["query"] = {m: to_raw(v, kinds.get(m, "vector")) for m, v in query.items()}
    if embeddings:
        body["embeddings"] = {m: _numbers(v) for m, v in embeddings.items()}
    for key, value in (("k", k), ("filter", filter), ("effort", effort)):
        if value is not None:
            body[key] = value
    return body


def _quote(record_id: str) -> str:
    from urllib.parse import quote

    return quote(record_id, safe="")


def _batch_item(x: Mapping[str, Any]) -> SearchResult | HclipError:
    if "results" in x:
        return SearchResult.from_json(x)
    return HclipError(int(x["status"]), x["error_type"], x["error"])


@dataclass(frozen=True)
class _Request:
    """One HTTP request for a client to send, after waiting wait_s (a retry's pause). The
    client's headers (api_key's included) go with every request it sends."""

    method: str
    path: str
    body: Any = None
    wait_s: float = 0.0


T = TypeVar("T")
# A call, as a generator: it yields each request to send; the client sends the response back in
# (or throws in the transport error sending raised) and gets the call's value at its return.
Call = Generator[_Request, httpx.Response, T]


class _Steps(Generic[T]):
    """A call, step by step, for a client's loop: each request to send, in turn, which the client
    answers (answer()) with its response or the transport error sending it raised; the call's
    value once it has returned."""

    def __init__(self, call: Call[T]):
        self._call = call
        self._answer: httpx.Response | httpx.TransportError  # the last request's
        self.value: T

    def answer(self, answer: httpx.Response | httpx.TransportError) -> None:
        self._answer = answer

    def __iter__(self) -> Iterator[_Request]:
        try:
            request = next(self._call)
            while True:
                yield request
                if isinstance(self._answer, httpx.Response):
                    request = self._call.send(self._answer)
                else:
                    request = self._call.throw(self._answer)
        except StopIteration as done:
            self.value = done.value


class _Core:
    """The settings, and every call once: which requests it makes and what their answers mean.
    Client and AsyncClient only send the requests (and wait between attempts)."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        retries: int,
        backoff_s: float,
        max_wait_s: float,
        headers: Mapping[str, str] | None,
        api_key: str | None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_wait_s = max_wait_s
        self.headers = dict(headers or {})
        if api_key is not None:  # a server with HCLIP_API_KEYS set
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._info: Info | None = None

    def decide(self, r: httpx.Response | None, attempt: int) -> float | None:
        """Seconds to wait before retrying, or None: give up (raise)."""
        if attempt >= self.retries:
            return None
        if r is not None and r.status_code != 503:
            return None
        return _wait_s(r, attempt, self.backoff_s, self.max_wait_s)

    def _exchange(self, method: str, path: str, body: Any = None) -> Call[Any]:
        """One request, retried as decide() says: its JSON answer, or the client's error."""
        return (yield from self._answered(method, path, body)).json()

    def _answered(self, method: str, path: str, body: Any = None) -> Call[httpx.Response]:
        """One request, retried as decide() says: its successful response, or the client's
        error."""
        request = _Request(method, path, body)
        attempt = 0
        while True:
            try:
                r = yield request
            except httpx.TimeoutException:
                raise HclipTimeout(0, "timeout", f"no answer within {self.timeout} s") from None
            except RETRYABLE as exc:
                wait = self.decide(None, attempt)
                if wait is None:
                    raise HclipError(0, "connection", str(exc)) from exc
            else:
                if r.is_success:
                    return r
                wait = self.decide(r, attempt)
                if wait is None:
                    raise _error(r)
            request = replace(request, wait_s=wait)
            attempt += 1

    def _info_call(self, refresh: bool) -> Call[Info]:
        if self._info is None or refresh:
            self._info = Info((yield from self._exchange("GET", "/v1/info")))
        return self._info

    def _health(self) -> Call[bool]:
        return bool((yield from self._exchange("GET", "/healthz"))["status"] == "ok")

    def _ready(self) -> Call[str]:
        return str((yield from self._exchange("GET", "/readyz"))["index_version"])

    def _search(
        self,
        query: Mapping[str, Any] | None,
        embeddings: Mapping[str, Any] | None,
        k: int | None,
        filter: Mapping[str, Any] | None,
        effort: int | None,
    ) -> Call[SearchResult]:
        kinds = (yield from self._info_call(False)).inputs if query else {}
        body = _search_body(query, embeddings, k, filter, effort, kinds)
        r = yield from self._answered("POST", "/v1/search", body)
        return SearchResult.from_json(r.json(), server_timing(r.headers.get("server-timing")))

    def _search_batch(
        self, searches: Sequence[Mapping[str, Any]]
    ) -> Call[list[SearchResult | HclipError]]:
        kinds = (yield from self._info_call(False)).inputs
        queries = [
            _search_body(s.get("query"), s.get("embeddings"), s.get("k"), s.get("filter"),
                         s.get("effort"), kinds)
            for s in searches
        ]  # fmt: skip
        out = yield from self._exchange("POST", "/v1/search/batch", {"queries": queries})
        return [_batch_item(x) for x in out["results"]]

    def _embed(self, modality: str, inputs: Sequence[Any]) -> Call[np.ndarray]:
        kind = (yield from self._info_call(False)).inputs.get(modality, "vector")
        body = {"modality": modality, "inputs": [to_raw(v, kind) for v in inputs]}
        out = yield from self._exchange("POST", "/v1/embed", body)
        return np.asarray(out["embeddings"], np.float32)

    # The query forms: they take any id (a path segment cannot hold a '/').
    def _record(self, record_id: str) -> Call[Record]:
        obj = yield from self._exchange("GET", f"/v1/records?id={_quote(record_id)}")
        return Record(obj["id"], obj["payload"], obj["modalities"], obj["index_version"])

    def _record_embeddings(self, record_id: str) -> Call[RecordEmbeddings]:
        obj = yield from self._exchange("GET", f"/v1/embeddings?id={_quote(record_id)}")
        embs = {m: np.asarray(v, np.float32) for m, v in obj["embeddings"].items()}
        return RecordEmbeddings(obj["id"], obj["index_version"], obj["model_fingerprint"], embs)


# --- the two clients: the I/O only ---------------------------------------------------------------


class Client(_Core):
    """The synchronous client; a context manager (or call close())."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_wait_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ):
        super().__init__(base_url, timeout, retries, backoff_s, max_wait_s, headers, api_key)
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout, headers=self.headers, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: Call[T]) -> T:
        steps = _Steps(call)
        for request in steps:
            time.sleep(request.wait_s)
            try:
                r = self._http.request(request.method, request.path, json=request.body)
            except httpx.TransportError as exc:
                steps.answer(exc)
            else:
                steps.answer(r)
        return steps.value

    def info(self, refresh: bool = False) -> Info:
        return self._run(self._info_call(refresh))

    def health(self) -> bool:
        return self._run(self._health())

    def ready(self) -> str:
        """The loaded index version (waits, within the retries, while the service loads)."""
        return self._run(self._ready())

    def search(
        self,
        query: Mapping[str, Any] | None = None,
        embeddings: Mapping[str, Any] | None = None,
        k: int | None = None,
        filter: Mapping[str, Any] | None = None,
        effort: int | None = None,
    ) -> SearchResult:
        return self._run(self._search(query, embeddings, k, filter, effort))

    def search_batch(
        self, searches: Sequence[Mapping[str, Any]]
    ) -> list[SearchResult | HclipError]:
        """Each search is a dict of search()'s keyword arguments; each answer is its result or
        its own error, in order."""
        return self._run(self._search_batch(searches))

    def embed(self, modality: str, inputs: Sequence[Any]) -> np.ndarray:
        """(len(inputs), d) embeddings of raw inputs of one modality."""
        return self._run(self._embed(modality, inputs))

    def record(self, record_id: str) -> Record:
        return self._run(self._record(record_id))

    def record_embeddings(self, record_id: str) -> RecordEmbeddings:
        return self._run(self._record_embeddings(record_id))


class AsyncClient(_Core):
    """The asynchronous client: the same methods, awaitable; an async context manager."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_wait_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ):
        super().__init__(base_url, timeout, retries, backoff_s, max_wait_s, headers, api_key)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers=self.headers, transport=transport
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _run(self, call: Call[T]) -> T:
        steps = _Steps(call)
        for request in steps:
            await asyncio.sleep(request.wait_s)
            try:
                r = await self._http.request(request.method, request.path, json=request.body)
            except httpx.TransportError as exc:
                steps.answer(exc)
            else:
                steps.answer(r)
        return steps.value

    async def info(self, refresh: bool = False) -> Info:
        return await self._run(self._info_call(refresh))

    async def health(self) -> bool:
        return await self._run(self._health())

    async def ready(self) -> str:
        return await self._run(self._ready())

    async def search(
        self,
        query: Mapping[str, Any] | None = None,
        embeddings: Mapping[str, Any] | None = None,
        k: int | None = None,
        filter: Mapping[str, Any] | None = None,
        effort: int | None = None,
    ) -> SearchResult:
        return await self._run(self._search(query, embeddings, k, filter, effort))

    async def search_batch(
        self, searches: Sequence[Mapping[str, Any]]
    ) -> list[SearchResult | HclipError]:
        return await self._run(self._search_batch(searches))

    async def embed(self, modality: str, inputs: Sequence[Any]) -> np.ndarray:
        return await self._run(self._embed(modality, inputs))

    async def record(self, record_id: str) -> Record:
        return await self._run(self._record(record_id))

    async def record_embeddings(self, record_id: str) -> RecordEmbeddings:
        return await self._run(self._record_embeddings(record_id))
