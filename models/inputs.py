"""Decoding raw inputs (docs/design.md §3): the public names, for callers and plugin authors.

Raw inputs are what records and queries carry: a string for `text`, a file path or a base64
`data:` URI for `image` and `audio`, a list of floats for `vector` and `embedding`, and whatever
a plugin's own `decode` takes for `plugin`. Each encoder decodes its own kind
(models.encoders); every failure raises InputError with a message that says what is wrong with
the value, and callers add the record or field it came from. An input over a size limit of
`InputLimits` raises InputTooLarge. Each limit is checked before the expensive part: media
bytes before base64 decoding, image pixels from the header before decompression, audio
duration and sample rate from the WAV header before any sample is read.
"""

from __future__ import annotations

from models.encoders import decode
from models.encoders.media import read_media
from models.limits import DEFAULT_LIMITS, FLOAT32_MAX, InputError, InputLimits, InputTooLarge

__all__ = [
    "DEFAULT_LIMITS",
    "FLOAT32_MAX",
    "InputError",
    "InputLimits",
    "InputTooLarge",
    "decode",
    "read_media",
]
