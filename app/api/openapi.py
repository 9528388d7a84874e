"""The OpenAPI document, specialised to the version being served.

The request models (app/api/schemas.py) take any modality name and any raw input, because the
model is only known once a version is loaded. /openapi.json then says what this deployment
accepts: the modalities by name, each with the schema of its kind (a string of text, a base64
data: URI, a list of exactly `dim` numbers), embeddings of exactly d numbers, the filterable
fields, and that a search names at least one modality. It is rebuilt when the served version
changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from app.api.schemas import BatchSearchRequest, EmbedRequest, SearchRequest
from app.core.settings import Settings
from app.services.versions import ServingVersion

# A data: URI of the kind's own type, application/octet-stream or none (models.encoders.media).
DATA_URI = r"^data:({kind}/[^,;]*|application/octet-stream)?(;[^,]*)?;base64,"
# Bodies the routes read themselves (app.api.http.json_body): their schemas are added here.
REQUEST_MODELS = (SearchRequest, BatchSearchRequest, EmbedRequest)


def with_article(word: str) -> str:
    """The word with its indefinite article: an audio embedding, a text one."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def raw_input_schema(kind: str, dim: int | None, settings: Settings) -> dict[str, Any]:
    if kind == "text":
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": settings.max_text_chars,
            "description": "text",
        }
    if kind in ("image", "audio"):
        what = "an image (PNG, JPEG...)" if kind == "image" else "a PCM WAV clip"
        return {
            "type": "string",
            "pattern": DATA_URI.format(kind=kind),
            "description": f"{what} as a base64 data: URI of type {kind}/*, "
            "application/octet-stream or none",
        }
    if dim is not None:
        return numbers(
            dim, f"the {dim} numbers of {with_article(kind)} input", settings.max_abs_value
        )
    return {"description": f"a raw input of the {kind!r} encoder kind"}


def numbers(n: int, description: str, bound: float) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "number", "minimum": -bound, "maximum": bound},
        "minItems": n,
        "maxItems": n,
        "description": description,
    }


def filter_schema(fields: dict[str, str]) -> dict[str, Any]:
    value = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
    props: dict[str, Any] = {}
    for name, kind in fields.items():
        scalar = {"type": "number"} if kind == "numeric" else value
        forms: list[dict[str, Any]] = [
            scalar,
            {
                "type": "object",
                "properties": {"in": {"type": "array", "items": scalar, "minItems": 1}},
                "required": ["in"],
                "additionalProperties": False,
            },
        ]
        if kind == "numeric":
            bound = {"type": "number"}
            forms.append(
                {
                    "type": "object",
                    "properties": {op: bound for op in ("gt", "gte", "lt", "lte")},
                    "minProperties": 1,
                    "additionalProperties": False,
                }
            )
        props[name] = {"anyOf": forms, "description": f"{with_article(kind)} payload field"}
    return {"type": "object", "properties": props, "additionalProperties": False}


def named_in(field: str, modality: str) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"required": [modality]}}}


def view_constraint(query: list[str], names: list[str]) -> dict[str, Any]:
    """A body whose named modalities are exactly `query`."""
    named = [{"anyOf": [named_in("query", m), named_in("embeddings", m)]} for m in query]
    absent = [
        {"not": {"anyOf": [named_in("query", m), named_in("embeddings", m)]}}
        for m in names
        if m not in query
    ]
    return {"allOf": named + absent}


def specialise(doc: dict[str, Any], serving: ServingVersion, settings: Settings) -> None:
    model = serving.model
    d = model.cfg.latent_dim
    kinds = {n: model.cfg.modalities[n] for n in model.names}
    raw = {n: raw_input_schema(c.raw_form, c.dim, settings) for n, c in kinds.items()}
    schemas = doc["components"]["schemas"]
    search = schemas["SearchRequest"]
    props = search["properties"]
    props["query"] = {
        "type": "object",
        "properties": raw,
        "additionalProperties": False,
        "maxProperties": len(kinds) - 1,
        "description": "modality -> raw input, encoded by the server",
    }
    props["embeddings"] = {
        "type": "object",
        "properties": {
            n: numbers(d, f"{with_article(n)} embedding (d = {d})", settings.max_abs_value)
            for n in kinds
        },
        "additionalProperties": False,
        "maxProperties": len(kinds) - 1,
        "description": "modality -> precomputed embedding",
    }
    props["k"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": settings.max_k},
                            {"type": "null"}]}  # fmt: skip
    props["effort"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": settings.max_effort},
                                 {"type": "null"}]}  # fmt: skip
    types = serving.index.records.fields.types
    props["filter"] = {"anyOf": [filter_schema(types), {"type": "null"}]}
    # The modalities named, raw or as embeddings, are exactly one view's query set; none is
    # named twice.
    search["anyOf"] = [
        view_constraint(list(view.query), list(kinds)) for view in serving.index.views.values()
    ]
    search["not"] = {
        "anyOf": [{"allOf": [named_in("query", m), named_in("embeddings", m)]} for m in kinds]
    }
    embed = schemas["EmbedRequest"]
    embed["properties"]["modality"] = {"type": "string", "enum": list(kinds)}
    embed["properties"]["inputs"]["maxItems"] = settings.max_embed_inputs
    # Which inputs are valid depends on the modality named beside them.
    embed["oneOf"] = [
        {
            "properties": {
                "modality": {"const": name},
                "inputs": {"type": "array", "items": schema},
            }
        }
        for name, schema in raw.items()
    ]
    batch = schemas["BatchSearchRequest"]
    batch["properties"]["queries"]["maxItems"] = settings.max_batch_queries


def install(app: FastAPI, settings: Settings, current: Callable[[], ServingVersion | None]) -> None:
    """Serve /openapi.json specialised to the served version (rebuilt when it changes)."""
    cache: dict[str | None, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        serving = current()
        key = serving.version if serving else None
        if key not in cache:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            _, top = models_json_schema(
                [(m, "validation") for m in REQUEST_MODELS],
                ref_template="#/components/schemas/{model}",
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(top["$defs"])
            if serving is not None:
                doc = copy.deepcopy(doc)
                specialise(doc, serving, settings)
            cache.clear()
            cache[key] = doc
        return cache[key]

    app.openapi = openapi  # type: ignore[method-assign]
