"""Small media records on disk, referenced by path, for training tests and the benchmark."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import numpy as np
from PIL import Image


def png_file(path: Path, rng: np.random.Generator, size: int = 12) -> None:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8)).save(buf, "PNG")
    path.write_bytes(buf.getvalue())


def wav_file(path: Path, rng: np.random.Generator, rate: int = 8000, seconds: float = 0.1) -> None:
    t = np.arange(int(rate * seconds)) / rate
    tone = np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.1 * rng.standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.4 * tone * 32767).astype("<i2").tobytes())


SENTENCES = ("a {} sound", "the picture shows {}", "{} again", "number {}")


def media_records(
    root: Path, n: int, pool: int, text: bool = False, seed: int = 0
) -> tuple[Path, dict[str, dict]]:
    """`n` records over a pool of `pool` PNG and WAV files (and templated sentences); returns
    the records file and the modalities of a model config that reads them."""
    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    for i in range(pool):
        png_file(media / f"{i}.png", rng)
        wav_file(media / f"{i}.wav", rng)
    path = root / "records.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            j = int(rng.integers(0, pool))
            row: dict = {
                "id": f"m-{i}",
                "image": f"media/{j}.png",
                "audio": f"media/{int(rng.integers(0, pool))}.wav",
                "v": rng.standard_normal(3).round(4).tolist(),
            }
            if text:
                row["text"] = SENTENCES[j % len(SENTENCES)].format(j)
            f.write(json.dumps(row) + "\n")
    modalities: dict[str, dict] = {
        "image": {"kind": "image", "image_size": 8, "conv_width": 4, "hidden": 8},
        "audio": {
            "kind": "audio",
            "sample_rate": 8000,
            "max_seconds": 0.1,
            "n_mels": 16,
            "conv_width": 4,
            "hidden": 8,
        },
        "v": {"kind": "vector", "dim": 3, "hidden": 8},
    }
    if text:
        modalities["text"] = {"kind": "text", "hidden": 8}
    return path, modalities
