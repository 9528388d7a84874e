"""Service settings: one pydantic-settings class read from HCLIP_* environment variables."""

from __future__ import annotations

import secrets
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from indexer.store.checked import default_directory
from models.limits import InputLimits
from models.machine import usable_cores


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HCLIP_", env_file=None, extra="ignore")

    root: Path = Field(Path("data/index"), description="index root (docs/design.md §5)")
    redis_url: str | None = Field(None, description="unset: an in-process LRU cache")
    admin_token: str | None = Field(None, description="bearer token for /v1/admin/*; unset: off")
    api_keys: str | None = Field(
        None,
        repr=False,
        description="comma-separated keys for the read routes (app.api.auth); unset: open",
    )
    api_keys_file: Path | None = Field(None, description="more read keys, one per line")
    metrics_key: str | None = Field(
        None, repr=False, description="the key of /metrics (default: the read keys)"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(
        default_factory=usable_cores,
        ge=1,
        le=256,
        description="`hclip serve` processes (default: one per core)",
    )
    workers_dir: Path | None = Field(
        None,
        description="set by `hclip serve` for its workers: where each says which version it "
        "serves (app.services.workers), so that /readyz waits for all of them",
    )
    instance: str = Field(
        "",
        description="names this process in the X-Hclip-Instance response header "
        "(default: host name and process id)",
    )
    server_timing: bool = Field(
        True,
        description="say in a Server-Timing response header where a request's time went "
        "(each encode and search: its wait, its call, its batch; the total); off where "
        "clients should not see it",
    )

    max_k: int = Field(100, ge=1, le=10_000)
    default_k: int = Field(10, ge=1)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_embed_inputs: int = Field(64, ge=1)
    max_batch_queries: int = Field(64, ge=1, description="searches in one /v1/search/batch")
    max_effort: int = Field(
        4096, ge=1, description="the largest ef_search or nprobe a request may ask for"
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request body must have arrived this long after the request "
        "began, else 408 and the connection is closed",
    )
    # Limits on one raw input, checked before any decoding (models.inputs.InputLimits).
    max_media_bytes: int = Field(6 * 1024 * 1024, ge=1024, description="one image or clip")
    max_image_pixels: int = Field(4096 * 4096, ge=64, description="width x height, from the header")
    max_audio_seconds: float = Field(60.0, gt=0, description="a clip's length, from its header")
    min_sample_rate: int = Field(1000, ge=1)
    max_sample_rate: int = Field(192_000, ge=1)
    max_text_chars: int = Field(4096, ge=1)
    max_abs_value: float = Field(
        1e6, gt=0, description="a number in a vector input or an embedding; larger is refused"
    )
    # Limits on a whole request's media (a batch's or an embed's inputs summed), from headers.
    max_request_pixels: int = Field(
        4 * 4096 * 4096, ge=64, description="the images of one request, width x height summed"
    )
    max_request_audio_seconds: float = Field(
        240.0, gt=0, description="the seconds its encoders read of one request's clips, summed"
    )

    # Backpressure: bounded queues, and a deadline after which a request gives up (503).
    max_pending: int = Field(256, ge=1, description="queued requests per batcher, then 503")
    request_timeout_s: float = Field(10.0, gt=0, description="per request, then 503")

    cache_ttl_s: int = Field(300, ge=1)
    cache_max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="the in-process cache of each worker, in bytes (entries are results and "
        "query embeddings; 0 keeps none); Redis is bounded by its own maxmemory",
    )
    redis_timeout_s: float = Field(0.05, gt=0, description="per Redis call; slower counts as down")
    redis_retry_s: float = Field(1.0, gt=0, description="after a Redis failure, skip it this long")
    cache_prefix: str = "hclip:v1"
    cache_secret: str = Field(
        default_factory=lambda: secrets.token_hex(32),
        repr=False,
        min_length=16,
        description="the key of the MACs that authenticate Redis entries (default: a random "
        "one per `hclip serve`, shared by its workers; give replicas that share a Redis the "
        "same one to share their entries)",
    )

    poll_interval_s: float = Field(2.0, gt=0, description="how often CURRENT is checked")
    reload_retry_s: float = Field(1.0, gt=0, description="first retry of a rejected version")
    reload_retry_max_s: float = Field(60.0, gt=0, description="backoff doubles up to this")
    verify_on_load: Literal["checksums", "quick", "full", "off"] = Field(
        "checksums",
        description="checksums: every file's checksum before a version first serves on this "
        "machine (remembered in HCLIP_CHECKED_DIR, so a restart does not read it again unless "
        "a file changed); quick: sizes and small files' checksums only, O(1) in the record "
        "count (an explicit opt-out); full: every checksum and every view's vectors "
        "recomputed at every load (as `hclip index verify`); off: none",
    )
    checked_dir: Path = Field(
        default_factory=default_directory,
        description="where this machine remembers the versions whose checksums passed "
        "(default: $XDG_CACHE_HOME/hclip/checked or ~/.cache/hclip/checked)",
    )
    media_dir: Path | None = Field(None, description="demo media served under /media")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where queries are encoded: auto (a GPU when torch sees one, under bf16 "
        "autocast where it supports it), cpu or cuda",
    )
    encoder_runtime: Literal["torch", "onnx", "onnx-int8"] = Field(
        "torch",
        description="what computes the frozen pretrained towers of a query (the `transformers` "
        "kind, and the `text` kind's MiniLM): torch, or ONNX Runtime on the CPU (the `onnx` "
        "extra), fp32 (onnx) or with dynamic int8 weights (onnx-int8); each tower is exported "
        "once, into the model directory's onnx/ (docs/models.md)",
    )
    milvus_uri: str | None = Field(
        None,
        description="the Milvus that versions on the milvus backend are searched in (default: "
        "the URI their build wrote; the token comes from HCLIP_MILVUS_TOKEN)",
    )
    milvus_timeout_s: float = Field(
        5.0, gt=0, description="each call to Milvus: past it the request answers 503"
    )
    batch_max: int = Field(64, ge=1, description="queries gathered into one FAISS call")
    batch_wait_ms: float = Field(0.0, ge=0, description="extra wait for a batch to fill")
    faiss_threads: int | None = Field(
        None,
        ge=1,
        description="FAISS's threads per search (default: the cores over the workers, so that "
        "N workers' searches together use every core once)",
    )
    faiss_blas_from: int = Field(
        8,
        ge=1,
        description="exact search runs FAISS's BLAS products from this many queries in a batch, "
        "its per-query scan below (indexer/search/exact.py)",
    )
    lone_query_threads: int = Field(
        default_factory=usable_cores,
        ge=1,
        description="threads a lone exact query scans its view on, in slices (default: the "
        "cores; indexer/search/lone_query.py)",
    )
    rerank_factor: int = Field(
        0,
        ge=0,
        le=1000,
        description="candidates per result that views of codes (a compact version's `sq8`, "
        "`ivfsq`, `ivfpq`) re-rank exactly; 0: each view's own `rerank` from its build "
        "(indexer/search/ann.py)",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="threads per tower encode (default: shared: a worker encoding alone takes "
        "every core, N workers encoding at once the cores over N each; "
        "app/services/core_share.py)",
    )

    search_on_loop: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run searches on each worker's event loop instead of its search thread. "
        "auto: on when the workers are at least as many as the cores, so that each worker "
        "has about one core (app/services/batching.py says why)",
    )

    def searches_on_loop(self) -> bool:
        on = self.search_on_loop
        return on == "on" or (on == "auto" and self.workers >= usable_cores())

    @model_validator(mode="after")
    def _threads_from_cores(self) -> Settings:
        share = max(1, usable_cores() // self.workers)  # each worker's share of the cores
        if self.faiss_threads is None:
            self.faiss_threads = share
        return self

    @property
    def search_threads(self) -> int:
        return self.faiss_threads or 1

    @property
    def encode_threads(self) -> int:
        """Each worker's share of the cores for encodes, unless HCLIP_TORCH_THREADS sets it (a
        shared count then gives a lone encode more: shared_encode_threads)."""
        return self.torch_threads or max(1, usable_cores() // self.workers)

    @property
    def shared_encode_threads(self) -> bool:
        return self.torch_threads is None

    def as_environment(self) -> dict[str, str]:
        """HCLIP_* variables that give a fresh process these settings."""
        out = {}
        for name, value in self.model_dump(mode="json").items():
            if value is not None:
                out[f"HCLIP_{name.upper()}"] = (
                    str(value).lower() if isinstance(value, bool) else (str(value))
                )
        return out

    def input_limits(self) -> InputLimits:
        return InputLimits(
            max_media_bytes=self.max_media_bytes,
            max_image_pixels=self.max_image_pixels,
            max_audio_seconds=self.max_audio_seconds,
            min_sample_rate=self.min_sample_rate,
            max_sample_rate=self.max_sample_rate,
            max_text_chars=self.max_text_chars,
            max_abs_value=self.max_abs_value,
        )

    @field_validator("cache_secret", mode="before")
    @classmethod
    def _secret_when_empty(cls, value: Any) -> Any:
        # An empty HCLIP_CACHE_SECRET (compose passes one through when the shell has none)
        # means unset: a random one.
        return secrets.token_hex(32) if value in (None, "") else value

    @field_validator("verify_on_load", mode="before")
    @classmethod
    def _legacy_bool(cls, value: Any) -> Any:
        # Before "quick" existed, true meant the full check and false none.
        legacy = {
            "true": "full",
            "1": "full",
            "false": "off",
            "0": "off",
            True: "full",
            False: "off",
        }
        return legacy.get(value.lower() if isinstance(value, str) else value, value)


@lru_cache
def get_settings() -> Settings:
    return Settings()
