"""Every check a request must pass against the served model, version and settings, in one place,
once: what it returns is what the search service consumes.

The body's shape and types were checked where it was parsed (app.api.schemas); what depends on
what is served is checked here: k and effort in their ranges, which view the named modalities
select, each raw input's type (and, for the cheap kinds, its value), each given embedding, the
filter against the version's declared fields, and how many queries or inputs a request holds.
Media are measured from their headers (an image's pixels, the seconds of a clip its encoder
reads): a request whose media sum over its budget is refused before any decoding is queued.
Each input's own limits are checked by its encoder, from the same header, so that in a batch
only the query holding it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from app.core.errors import ApiError, InvalidInput, TooLarge, Unanswerable, out_of_range
from app.core.settings import Settings
from app.services.versions import ServingVersion
from indexer.store.fields import FilterError
from models.encoders import decode
from models.encoders.decode_cost import decode_cost
from models.limits import FLOAT32_MAX, InputError, InputLimits, InputTooLarge


class SearchBody(Protocol):
    """What a search names (app.api.schemas.SearchRequest, once it fits the schema)."""

    query: dict[str, Any]
    embeddings: dict[str, list[float]]
    k: int | None
    effort: int | None

    def filter_dict(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class CheckedSearch:
    """A search after its checks: what it asks, resolved against the served version."""

    view: str
    k: int
    filter: dict[str, Any] | None
    effort: int | None  # None for exact views, which have none to set
    query: dict[str, Any]  # modality -> raw input as it came (the cache keys hash it)
    raw: dict[str, Any]  # modality -> raw input for its encoder (a `vector` one decoded)
    given: dict[str, np.ndarray]  # modality -> the request's embedding, checked
    field: str  # where the query's values came from: named if its factor is not finite


@dataclass(frozen=True)
class CheckedEmbed:
    modality: str
    values: list[Any]  # raw inputs for the modality's encoder
    fields: list[str]  # where each came from, named in its error


def as_api_error(field: str, exc: InputError) -> ApiError:
    cls = TooLarge if isinstance(exc, InputTooLarge) else InvalidInput
    return cls(f"{field}: {exc}")


class MediaBudget:
    """What one request's media will cost to decode, summed as its inputs are checked."""

    def __init__(self, settings: Settings):
        self.limits = {
            "image": (float(settings.max_request_pixels), "pixels", "HCLIP_MAX_REQUEST_PIXELS"),
            "audio": (
                settings.max_request_audio_seconds,
                "s of audio",
                "HCLIP_MAX_REQUEST_AUDIO_SECONDS",
            ),
        }
        self.spent = {"image": 0.0, "audio": 0.0}

    def spend(self, field: str, form: str, cost: float) -> None:
        if form not in self.spent:
            return
        self.spent[form] += cost
        limit, unit, setting = self.limits[form]
        digits = 0 if form == "image" else 1
        if self.spent[form] > limit:
            raise TooLarge(
                f"{field}: the request's media reach {self.spent[form]:.{digits}f} {unit} to "
                f"decode, over the limit of {limit:.{digits}f} per request ({setting})"
            )


class RequestChecks:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.limits: InputLimits = settings.input_limits()

    def search(
        self, serving: ServingVersion, body: SearchBody, budget: MediaBudget | None = None
    ) -> CheckedSearch:
        """Everything about a search that can be refused before any work is queued."""
        s = self.settings
        budget = MediaBudget(s) if budget is None else budget
        k = s.default_k if body.k is None else body.k
        if not 1 <= k <= s.max_k:
            raise out_of_range("k", k, 1, s.max_k, "HCLIP_MAX_K")
        if body.effort is not None and not 1 <= body.effort <= s.max_effort:
            raise out_of_range("effort", body.effort, 1, s.max_effort, "HCLIP_MAX_EFFORT")
        view_name = "+".join(self._modalities(serving, list(body.query), list(body.embeddings)))
        view = serving.index.views.get(view_name)
        if view is None:
            views = ", ".join(serving.searchers)
            raise Unanswerable(f"no index for query modalities {view_name!r} (views: {views})")
        raw = {m: self._raw(serving, m, v, f"query.{m}", budget) for m, v in body.query.items()}
        d = serving.model.cfg.latent_dim
        given = {m: self._embedding(f"embeddings.{m}", v, d) for m, v in body.embeddings.items()}
        flt = body.filter_dict()
        if flt is not None:
            try:
                serving.index.records.fields.validate(flt)
            except FilterError as exc:
                raise InvalidInput(str(exc)) from None
        effort = None if view.spec.exact else body.effort
        field = "embeddings" if body.embeddings else "query"
        return CheckedSearch(view_name, k, flt, effort, body.query, raw, given, field)

    def batch(self, serving: ServingVersion, queries: Sequence[SearchBody]) -> list[CheckedSearch]:
        """A batch is checked as a whole: a query that fails refuses the batch, naming
        `queries[i]`."""
        limit = self.settings.max_batch_queries
        if len(queries) > limit:
            raise out_of_range("queries", len(queries), 1, limit, "HCLIP_MAX_BATCH_QUERIES")
        checked, budget = [], MediaBudget(self.settings)
        for i, q in enumerate(queries):
            try:
                checked.append(self.search(serving, q, budget))
            except ApiError as exc:
                exc.message = f"queries[{i}].{exc.message}"
                raise
        return checked

    def embed(self, serving: ServingVersion, modality: str, inputs: list[Any]) -> CheckedEmbed:
        names = serving.model.names
        if modality not in names:
            raise InvalidInput(
                f"modality: unknown modality {modality!r} (model has: {', '.join(names)})"
            )
        limit = self.settings.max_embed_inputs
        if len(inputs) > limit:
            raise out_of_range("inputs", len(inputs), 1, limit, "HCLIP_MAX_EMBED_INPUTS")
        fields = [f"inputs[{i}]" for i in range(len(inputs))]
        budget = MediaBudget(self.settings)
        values = [
            self._raw(serving, modality, v, f, budget) for v, f in zip(inputs, fields, strict=True)
        ]
        return CheckedEmbed(modality, values, fields)

    @staticmethod
    def _modalities(
        serving: ServingVersion, raw: Sequence[str], given: Sequence[str]
    ) -> tuple[str, ...]:
        names = serving.model.names
        both = sorted(set(raw) & set(given))
        if both:
            raise InvalidInput(f"query.{both[0]}: given both raw and as an embedding")
        modalities = tuple(sorted(set(raw) | set(given)))
        for m in modalities:
            if m not in names:
                field = "query" if m in raw else "embeddings"
                raise InvalidInput(
                    f"{field}.{m}: unknown modality {m!r} (model has: {', '.join(names)})"
                )
        if not modalities:
            raise InvalidInput("query: names no modality: give 'query' or 'embeddings'")
        if len(modalities) == len(names):
            raise Unanswerable("the query names every modality: nothing is left to retrieve")
        return modalities

    def _raw(
        self, serving: ServingVersion, modality: str, value: Any, field: str, budget: MediaBudget
    ) -> Any:
        """A raw input's type, and for the cheap kinds (texts, vectors) its value; media are
        measured from their headers here and decoded by their encoder's thread. A `vector`
        input is returned decoded (its encoder runs inline and takes it as it is), any other
        as it came."""
        cfg = serving.model.cfg.modalities[modality]
        # A client must not make the server read its own files: media come inline only.
        if cfg.raw_form in ("image", "audio"):
            if not (isinstance(value, str) and value.startswith("data:")):
                raise InvalidInput(f"{field}: {cfg.raw_form} must be a base64 data: URI")
            try:
                cost = decode_cost(value, cfg, self.limits)
            except InputError:
                cost = 0.0  # refused by its encoder from the same header: only its query fails
            budget.spend(field, cfg.raw_form, cost)
        elif cfg.raw_form in ("text", "vector", "embedding"):
            try:
                decoded = decode(value, cfg, base_dir=None, limits=self.limits)
            except InputError as exc:
                raise as_api_error(field, exc) from None
            return decoded if cfg.kind == "vector" else value
        return value

    def _embedding(self, field: str, value: list[float], d: int) -> np.ndarray:
        if len(value) != d:
            raise InvalidInput(
                f"{field}: expected {d} numbers (the model's latent d), got {len(value)}"
            )
        magnitude = np.abs(np.asarray(value, dtype=np.float64))
        if not (np.isfinite(magnitude).all() and (magnitude <= FLOAT32_MAX).all()):
            raise InvalidInput(f"{field}: holds NaN, infinite or out-of-float32-range values")
        bound = self.settings.max_abs_value
        if (magnitude > bound).any():
            raise InvalidInput(f"{field}: holds a number beyond +-{bound:g} (HCLIP_MAX_ABS_VALUE)")
        return np.asarray(value, dtype=np.float32)
