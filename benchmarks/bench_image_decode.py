"""A raw photo query's decode, whole and at the smallest JPEG scale its processor needs. Prints
figures; it is not a test (a shared machine is noisy).

    python benchmarks/bench_image_decode.py
    python benchmarks/bench_image_decode.py --sizes 1920x1080,4032x3024 --repeat 30

For photo-like JPEGs (smooth colour fields with grain, quality 90) at each size, in turn on the
same bytes: the decode as it was (Pillow decodes every pixel, then the processor resizes) and
as models.encoders.image decodes it now (libjpeg's smallest scale that keeps both sides at
least the processor's, Pillow's `draft`), each followed by the tower's processor, for the
processors of ViT-B/16 (224 x 224) and CLIP (shortest edge 224, centre crop 224) as
transformers makes them by default (no weights needed). It prints the medians in ms, their
ratio, and how far apart the two pixel tensors are, in grey levels (1/255 of the range before
the processor's normalisation).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from typing import Any

import numpy as np

from models.encoders.image import decode_image_file
from models.encoders.tower_inputs import processor_side
from models.limits import InputLimits


def photo(width: int, height: int, seed: int = 0) -> bytes:
    """A photo-like JPEG: three smooth colour fields with grain (noise alone would make the
    entropy decoding, the part no scale saves, unrealistically heavy)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    fields = np.stack([np.sin(6 * x + k) * np.cos(4 * y - k) for k in range(3)], -1)
    grain = np.random.default_rng(seed).normal(0, 12, (height, width, 3))
    pixels = np.clip(fields * 90 + 128 + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def timed(data: bytes, processor: Any, side: int | None, limits: InputLimits) -> tuple[float, Any]:
    t0 = time.perf_counter()
    image = decode_image_file(data, limits, "RGB", side)
    pixels = processor(images=[image], return_tensors="np")["pixel_values"][0]
    return time.perf_counter() - t0, pixels


def main() -> None:
    import transformers as tf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="640x480,1280x960,1920x1080,4032x3024")
    p.add_argument("--repeat", type=int, default=20, help="decodes of each kind and size")
    args = p.parse_args()
    limits = InputLimits()
    processors: dict[str, Any] = {
        "ViT-B/16": tf.ViTImageProcessor(),
        "CLIP": tf.CLIPImageProcessor(),
    }
    print(f"{'processor':9} {'photo':>10} {'KB':>6} {'whole':>8} {'scaled':>8} {'ratio':>6} "
          f"{'decoded':>10} {'mean diff':>10} {'max diff':>9}")  # fmt: skip
    for name, processor in processors.items():
        side = processor_side(processor)
        std = float(np.mean(processor.image_std))
        for size in args.sizes.split(","):
            w, h = (int(v) for v in size.split("x"))
            data = photo(w, h)
            runs: dict[str, list[float]] = {"whole": [], "scaled": []}
            out: dict[str, Any] = {}
            for _ in range(args.repeat):  # in turn, so that a drift of the host hits both
                for kind, at_least in (("whole", None), ("scaled", side)):
                    took, out[kind] = timed(data, processor, at_least, limits)
                    runs[kind].append(took)
            whole, scaled = (1e3 * statistics.median(runs[k]) for k in ("whole", "scaled"))
            decoded = decode_image_file(data, limits, "RGB", side).size
            levels = np.abs(out["whole"] - out["scaled"]) * std * 255  # normalised -> grey levels
            print(f"{name:9} {size:>10} {len(data) // 1024:6d} {whole:7.1f}ms {scaled:7.1f}ms "
                  f"{whole / scaled:5.2f}x {decoded[0]:>4}x{decoded[1]:<5} {levels.mean():10.2f} "
                  f"{levels.max():9.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
