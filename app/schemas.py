"""The HTTP API's request and response bodies: the OpenAPI document is generated from these.

Numbers are strict where JSON would let a mistake pass: `k: true` is not 1, and a boolean in a
vector is not a number. Values that depend on the loaded model (which modalities exist, a
vector's length) are checked by the handlers, with the same 422 and error envelope.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Number = Annotated[float, Field(strict=True)]  # an int or a float, never a boolean
RawInput = Annotated[
    str | list[Number],
    Field(
        description="text for a `text` modality; a base64 `data:` URI for `image` and `audio`; "
        "the numbers of a `vector` (or `embedding`) modality"
    ),
]


class ErrorBody(BaseModel):
    """Every error: what is wrong (naming the field), a stable type, and the request's id."""

    error: str
    error_type: str
    request_id: str | None = None


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: dict[str, RawInput] = Field(
        default_factory=dict, description="modality -> raw input, encoded by the server"
    )
    embeddings: dict[str, list[Number]] = Field(
        default_factory=dict,
        description="modality -> precomputed embedding (the model's latent d numbers, "
        "as GET /v1/records/{id}/embeddings or POST /v1/embed return them)",
    )
    k: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="results wanted (default HCLIP_DEFAULT_K, at most HCLIP_MAX_K)"
    )


class SearchHit(BaseModel):
    id: str
    score: float = Field(description="the head's score: omega . (query product * record product)")
    payload: dict[str, Any]


class SearchResponse(BaseModel):
    index_version: str
    view: str = Field(description="the query modalities joined with '+', sorted")
    results: list[SearchHit]
    cached: bool


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modality: str
    inputs: list[RawInput] = Field(min_length=1, description="raw inputs of that modality")


class EmbedResponse(BaseModel):
    model_fingerprint: str
    embeddings: list[list[float]]


class RecordResponse(BaseModel):
    id: str
    payload: dict[str, Any]
    modalities: list[str]
    index_version: str


class RecordEmbeddingsResponse(BaseModel):
    id: str
    index_version: str
    model_fingerprint: str
    embeddings: dict[str, list[float]]


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    index_version: str


class ViewInfo(BaseModel):
    query: list[str]
    target: list[str]
    count: int
    spec: dict[str, Any]
    recall_at_10: float | None


class RejectedVersion(BaseModel):
    version: str
    reason: str
    attempts: int
    next_retry_in_s: float


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow")  # the head's own parameters (omega, logit_scale)

    fingerprint: str
    head: str
    modalities: dict[str, str] = Field(description="modality -> encoder kind")
    d: int


class InfoResponse(BaseModel):
    model: ModelInfo
    index_version: str
    parent_version: str | None
    created: str | None
    views: dict[str, ViewInfo]
    counts: dict[str, Any]
    cache: str
    rejected_versions: list[RejectedVersion]


class ReloadResponse(BaseModel):
    changed: bool
    index_version: str | None
