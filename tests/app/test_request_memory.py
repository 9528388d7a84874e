"""Memory and decode work a client can make a worker spend: a failed decode keeps nothing,
a request's media are bounded in pixels and seconds as a whole, the result cache in bytes."""

from __future__ import annotations

import functools
import io
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from tests.app.conftest import running, settings_for
from tests.app.test_hostile import media_root, rss_mb, slow_png  # noqa: F401 (a fixture)
from tests.models.test_inputs import data_uri

AT_LIMIT = 4096  # the service's default max_image_pixels is 4096 x 4096


@functools.cache
def corrupt_png() -> bytes:
    """A 4096 x 4096 grey PNG whose zlib checksum is broken: its header is legal, so the
    decoder allocates the whole image before the stream fails at its end."""
    buf = io.BytesIO()
    Image.new("L", (AT_LIMIT, AT_LIMIT), 7).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    at = data.rfind(b"IDAT")
    (length,) = struct.unpack(">I", data[at - 4 : at])
    data[at + 4 + length - 1] ^= 0xFF  # the stream's last byte: its Adler-32
    return bytes(data)


def variant(png: bytes, i: int) -> str:
    """Distinct bytes (PNG readers ignore what follows the image), so no cache answers."""
    return data_uri("image/png", png + i.to_bytes(4, "big"))


def test_corrupt_images_at_the_pixel_limit_keep_no_memory(media_root: Path) -> None:  # noqa: F811
    with running(settings_for(media_root)) as client:

        def send(i: int) -> int:
            body = {"query": {"image": variant(corrupt_png(), i)}, "k": 3}
            return client.post("/v1/search", json=body).status_code

        with ThreadPoolExecutor(4) as pool:
            assert set(pool.map(send, range(8))) == {422}  # warm: thread arenas, pools
            before = rss_mb()
            assert set(pool.map(send, range(100, 150))) == {422}
        after = rss_mb()
    assert after - before < 50, (before, after)
