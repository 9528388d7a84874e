"""The demo's data: digits shown (scikit-learn's scanned digits), spoken (espeak-ng) and written.

Everything comes from installed packages; nothing is fetched. Two datasets of records:
- `shared`: one digit d shown, spoken and written;
- `interaction`: an image of a, a spoken b, and the text of (a + b) mod 10. Every pair of
  modalities is independent, so only the three together carry information.
Held-out images, voices and sentence templates are kept apart for evaluation and serving.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.extras import require

log = logging.getLogger(__name__)

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Unseen voices are what limits held-out audio retrieval, so the training side gets many: 12
# voices (accents and espeak-ng's voice variants), none of them a held-out accent or variant,
# each at 3 speeds and 3 pitches. Training also plays every clip at a random speed
# (app/demo/tuples.py), which costs nothing here; espeak-ng costs about 8 ms a clip.
TRAIN_VOICES = [
    *("en-gb", "en-us", "en-gb-scotland", "en-029", "en-gb-x-rp+f2", "en-us+m3"),
    *("en-gb-x-gbcwmd", "en-gb-scotland+f3", "en-029+f1", "en-us+f5", "en-gb+m5", "en-us+m7"),
]
HELD_OUT_VOICES = ["en-us-nyc", "en-gb-x-gbclan+f4"]
PROSODY = {  # split -> (speeds in words per minute, pitches 0-99)
    "train": ((125, 175, 225), (30, 50, 70)),
    "held_out": ((140, 175, 210), (35, 50, 65)),
}
TRAIN_TEMPLATES = [
    "{w}",
    "{d}",
    "the number {w}",
    "digit {w}",
    "{w} items",
    "I count {w}",
    "it is {w}",
    "a {w}",
    "{W}",
    "number {d}",
]
HELD_OUT_TEMPLATES = ["exactly {w}", "{w}, please", "the digit {d}"]
DATASETS = ("shared", "interaction")


class DemoError(RuntimeError):
    """The demo cannot run here (a missing system package, say); the message says what to do."""


def ensure_espeak() -> str:
    """espeak-ng from Debian: installed on the fly where we may (root with apt-get).

    apt-get's own output (package lists, unpacking, triggers) says nothing a demo user needs, so
    it is captured: one notice says what happens, and only a failure shows apt-get's last lines.
    """
    exe = shutil.which("espeak-ng")
    if exe:
        return exe
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing espeak-ng, Debian's speech synthesiser (about a minute)...", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        output = ""
        # A failed update may still leave lists good enough to install from: only the install
        # decides.
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "espeak-ng"]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            output += done.stdout + done.stderr
        exe = shutil.which("espeak-ng")
        if done.returncode != 0 or not exe:
            tail = "\n".join(output.strip().splitlines()[-5:])
            raise DemoError(
                f"installing espeak-ng with apt-get failed (exit {done.returncode}); install it "
                f"with `apt-get install espeak-ng` and run the demo again. apt-get said:\n{tail}"
            )
    if not exe:
        raise DemoError(
            "the demo needs espeak-ng (it speaks the spoken digits), and only root can install "
            "it here: run `sudo apt-get install espeak-ng` (Debian, Ubuntu) or `brew install "
            "espeak-ng` (macOS), then the demo again"
        )
    return exe


@dataclass(frozen=True)
class Media:
    """Relative paths (to the data dir) of the media of one digit, by split."""

    images: dict[str, list[list[str]]]  # split -> digit -> paths
    clips: dict[str, list[list[str]]]
    texts: dict[str, list[list[str]]]


def _write_images(out: Path) -> dict[str, list[list[str]]]:
    from PIL import Image

    load_digits = require("sklearn.datasets", "demo", "the demo's digit images").load_digits

    digits = load_digits()
    (out / "images").mkdir(parents=True, exist_ok=True)
    split: dict[str, list[list[str]]] = {s: [[] for _ in range(10)] for s in ("train", "held_out")}
    for i, (img, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        rel = f"images/{i:04d}.png"
        pixels = (img * 255.0 / 16.0).clip(0, 255).astype(np.uint8)  # (8, 8) scans, 0..16
        Image.fromarray(pixels).resize((32, 32), Image.Resampling.NEAREST).save(out / rel)
        split["held_out" if i % 4 == 0 else "train"][int(label)].append(rel)
    return split


def _write_clips(out: Path, espeak: str) -> dict[str, list[list[str]]]:
    (out / "audio").mkdir(parents=True, exist_ok=True)
    jobs = []
    split: dict[str, list[list[str]]] = {s: [[] for _ in range(10)] for s in ("train", "held_out")}
    for name, voices in (("train", TRAIN_VOICES), ("held_out", HELD_OUT_VOICES)):
        speeds, pitches = PROSODY[name]
        for d, word in enumerate(WORDS):
            for voice in voices:
                for speed in speeds:
                    for pitch in pitches:
                        rel = f"audio/{word}_{voice.replace('+', '_')}_{speed}_{pitch}.wav"
                        split[name][d].append(rel)
                        jobs.append(
                            [
                                espeak,
                                "-v",
                                voice,
                                "-s",
                                str(speed),
                                "-p",
                                str(pitch),
                                "-w",
                                str(out / rel),
                                word,
                            ]
                        )

    def speak(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    with ThreadPoolExecutor(4) as pool:  # espeak-ng writes a clip in under 10 ms
        list(pool.map(speak, jobs))
    return split


def _texts() -> dict[str, list[list[str]]]:
    def fill(templates: list[str]) -> list[list[str]]:
        return [
            [t.format(w=w, W=w.capitalize(), d=d) for t in templates] for d, w in enumerate(WORDS)
        ]

    return {"train": fill(TRAIN_TEMPLATES), "held_out": fill(HELD_OUT_TEMPLATES)}


def media_spec() -> dict[str, Any]:
    """What the media depend on; media.json records it, and media built otherwise are redone.
    (Through JSON, so that it compares equal to what media.json reads back.)"""
    spec = {
        "voices": {"train": TRAIN_VOICES, "held_out": HELD_OUT_VOICES},
        "prosody": PROSODY,
        "templates": {"train": TRAIN_TEMPLATES, "held_out": HELD_OUT_TEMPLATES},
    }
    return dict(json.loads(json.dumps(spec)))


def build_media(out: Path) -> Media:
    """Write every image and clip once; cheap to call again (it reuses what is there)."""
    marker = out / "media.json"
    if marker.exists():
        m = json.loads(marker.read_text())
        if m.get("spec") == media_spec():
            return Media(m["images"], m["clips"], m["texts"])
        log.warning("the media in %s were made by another version of the demo: redoing them", out)
        marker.unlink()
        for name in ("images", "audio"):
            shutil.rmtree(out / name, ignore_errors=True)
    espeak = ensure_espeak()
    media = Media(_write_images(out), _write_clips(out, espeak), _texts())
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"spec": media_spec(), **media.__dict__}))
    os.replace(tmp, marker)
    return media


def digits_for(dataset: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 3) digits shown as image, audio and text."""
    if dataset == "shared":
        d = rng.integers(0, 10, n)
        return np.stack([d, d, d], axis=1)
    a, b = rng.integers(0, 10, n), rng.integers(0, 10, n)
    return np.stack([a, b, (a + b) % 10], axis=1)


def relevant(dataset: str, image: np.ndarray, audio: np.ndarray, text: np.ndarray) -> np.ndarray:
    if dataset == "shared":
        return (image == audio) & (audio == text)
    return (image + audio) % 10 == text


def make_records(
    dataset: str, media: Media, split: str, n: int, seed: int, prefix: str
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i, (a, b, c) in enumerate(digits_for(dataset, rng, n).tolist()):
        image = str(rng.choice(media.images[split][a]))
        clip = str(rng.choice(media.clips[split][b]))
        text = str(rng.choice(media.texts[split][c]))
        rows.append(
            {
                "id": f"{prefix}-{i:05d}",
                # the records files sit one level below the media
                "image": f"../{image}",
                "audio": f"../{clip}",
                "text": text,
                "payload": {
                    "digits": {"image": a, "audio": b, "text": c},
                    "image_url": f"/media/{image}",
                    "audio_url": f"/media/{clip}",
                    "text": text,
                },
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path
