"""The HTTP API's request and response bodies: the OpenAPI document is generated from these.

Numbers are strict where JSON would let a mistake pass: `k: true` is not 1, a boolean in a
vector is not a number, and a number beyond a double (1e400) is not infinity. The counts below
bound what a body can make the parser build, whatever the settings; what depends on the served
model and the settings (which modalities exist, a vector's length, k's range, how many queries
a batch may hold) is checked once, by app.services.checks, with the same 422 and error envelope.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    model_validator,
)

# an int or a float, never a boolean, never infinite
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# What one body may hold, at most, before any setting applies (the settings' own bounds are
# smaller and checked by app.services.checks).
MAX_MODALITIES = 64  # modalities named in a query or an embeddings object
MAX_NUMBERS = 1 << 16  # numbers in one vector or embedding
MAX_FILTER_FIELDS = 64  # fields in a filter
MAX_IN_VALUES = 4096  # values in a filter's `in` list
MAX_ITEMS = 1024  # queries in a batch, inputs in an embed request


def _integral(value: Any) -> Any:
    """JSON's integers, 3.0 included (JSON Schema counts it as an integer); not true."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Any integer: its range is the server's settings', checked with them by the search service
# (app.services.search), so that k: 0 and k: 10^6 are refused alike, naming range and setting.
Count = Annotated[int, BeforeValidator(_integral), Field(strict=True)]
RawInput = Annotated[
    str | Annotated[list[Number], Field(max_length=MAX_NUMBERS)],
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


FilterScalar = Annotated[StrictStr | StrictBool | Number, Field(description="a value to equal")]


class InCondition(BaseModel):
    """The field equals one of these values."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    in_: list[FilterScalar] = Field(alias="in", min_length=1, max_length=MAX_IN_VALUES)


class RangeCondition(BaseModel):
    """A numeric field within bounds (any of gt, gte, lt, lte; all must hold)."""

    model_config = ConfigDict(extra="forbid")
    gt: Number | None = None
    gte: Number | None = None
    lt: Number | None = None
    lte: Number | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_null_bounds(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            raise ValueError("a range's bounds are numbers, not null")
        return data

    @model_validator(mode="after")
    def _some_bound(self) -> RangeCondition:
        if all(v is None for v in (self.gt, self.gte, self.lt, self.lte)):
            raise ValueError("a range needs at least one of gt, gte, lt, lte")
        return self


FilterCondition = FilterScalar | InCondition | RangeCondition


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: dict[str, RawInput] = Field(
        default_factory=dict,
        max_length=MAX_MODALITIES,
        description="modality -> raw input, encoded by the server",
    )
    embeddings: dict[str, Annotated[list[Number], Field(max_length=MAX_NUMBERS)]] = Field(
        default_factory=dict,
        max_length=MAX_MODALITIES,
        description="modality -> precomputed embedding (the model's latent d numbers, "
        "as GET /v1/records/{id}/embeddings or POST /v1/embed return them)",
    )
    k: Count | None = Field(
        None, description="results wanted (default HCLIP_DEFAULT_K, at most HCLIP_MAX_K)"
    )
    filter: dict[str, FilterCondition] | None = Field(
        None,
        max_length=MAX_FILTER_FIELDS,
        description="conditions on payload fields declared filterable at build time, all of "
        "which must hold: a value (equality), {'in': [values]}, or a numeric range "
        "{'gte': 2020, 'lt': 2024}; applied during the search, so k results come back "
        "whenever k records match",
    )
    effort: Count | None = Field(
        None,
        description="an approximate view's search effort (HNSW ef_search, IVF nprobe), up to "
        "HCLIP_MAX_EFFORT; exact views ignore it",
    )

    def filter_dict(self) -> dict[str, Any] | None:
        """The filter as plain JSON values (an `in` condition keyed "in")."""
        if self.filter is None:
            return None
        out: dict[str, Any] = {}
        for name, cond in self.filter.items():
            if isinstance(cond, InCondition):
                out[name] = {"in": list(cond.in_)}
            elif isinstance(cond, RangeCondition):
                out[name] = cond.model_dump(exclude_none=True)
            else:
                out[name] = cond
        return out


class SearchHit(BaseModel):
    id: str
    score: float = Field(description="the head's score: omega . (query product * record product)")
    payload: dict[str, Any]


class SearchResponse(BaseModel):
    index_version: str
    view: str = Field(description="the query modalities joined with '+', sorted")
    results: list[SearchHit]
    cached: bool
    effort: int | None = Field(
        None, description="the effort an approximate view searched with; absent for exact views"
    )


class BatchSearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[SearchRequest] = Field(
        min_length=1,
        max_length=MAX_ITEMS,
        description="searches answered in order (at most HCLIP_MAX_BATCH_QUERIES)",
    )


class BatchItemError(ErrorBody):
    status: int = Field(description="the status this query alone would have got")


class BatchSearchResponse(BaseModel):
    results: list[SearchResponse | BatchItemError] = Field(
        description="one per query, in order: its response, or its error"
    )


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modality: str
    inputs: list[RawInput] = Field(
        min_length=1, max_length=MAX_ITEMS, description="raw inputs of that modality"
    )


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
    warning: str | None = None  # CURRENT names no version of the root: what serves instead


class ViewInfo(BaseModel):
    query: list[str]
    target: list[str]
    count: int
    spec: dict[str, Any]
    recall_at_10: float | None
    tuning: dict[str, Any] | None = Field(
        None,
        description="for a view the tuner chose (--spec auto): the pick, the batch size it "
        "served at, its and flat search's queries/s alone and in batches, or why it stayed flat",
    )
    milvus: dict[str, Any] | None = Field(
        None,
        description="for a view held in Milvus (--backend milvus): its collection and index type",
    )
    stores: str | None = Field(
        None,
        description="for a compact version's view (--compact): `float16` (searched exactly) or "
        "`codes:SQ8`, `codes:IVF-SQ8`, `codes:IVF-PQ` (candidates re-ranked exactly)",
    )


class RejectedVersion(BaseModel):
    version: str
    reason: str
    attempts: int
    next_retry_in_s: float | None = Field(
        description="null: its files failed their checks, and it is tried again only when they "
        "change or on POST /v1/admin/reload"
    )


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
    backend: str = Field("faiss", description="where the views live: faiss or milvus")
    cache: str
    rejected_versions: list[RejectedVersion]


class ReloadResponse(BaseModel):
    changed: bool
    index_version: str | None
