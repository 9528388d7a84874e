"""A text input, checked: what the `text` kind and a `transformers` text tower take."""

from __future__ import annotations

from typing import Any

from models.limits import DEFAULT_LIMITS, InputError, InputLimits


def decode_text(value: Any, limits: InputLimits = DEFAULT_LIMITS) -> str:
    if not isinstance(value, str):
        raise InputError(f"text must be a string, got {type(value).__name__}")
    if len(value) > limits.max_text_chars:
        raise InputError(
            f"text is {len(value)} characters, over the limit of {limits.max_text_chars} "
            "(max_text_chars)"
        )
    if not value.strip():
        raise InputError("text is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"text is not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None
    return value
