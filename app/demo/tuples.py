"""Training tuples drawn afresh: each training step sees (image, audio, text) combinations that
no earlier step saw.

The training media (about 1,350 scans, the training voices' clips and sentences) allow some
10^8 distinct interaction tuples, and a fixed set of a few thousand, revisited every epoch, lets
a model memorise its combinations instead of learning the digits. Here the media are decoded
once into memory and a seeded generator draws the digits and the media of every row, so the
trainer reads `steps x batch` tuples, each used once, at no decoding cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.demo.data import Media, digits_for
from models.config import ModelConfig
from models.encoders import decode
from models.train.data import input_key

MODALITIES = ("image", "audio", "text")


@dataclass(frozen=True)
class Pool:
    """One modality's decoded media of one split: items, their keys, and each one's digit."""

    items: list[Any]
    keys: torch.Tensor  # (P,) int64: input_key of each item, so that equal inputs mask alike
    by_digit: list[np.ndarray]  # digit -> positions in items


def decode_pool(
    paths: Sequence[Sequence[str]], cfg: ModelConfig, modality: str, base: Path
) -> Pool:
    """Decode every item of `paths` (digit -> raw inputs) for the model's `modality`."""
    items: list[Any] = []
    by_digit = []
    for digit_paths in paths:
        start = len(items)
        items += [decode(p, cfg.modalities[modality], base) for p in digit_paths]
        by_digit.append(np.arange(start, len(items)))
    keys = torch.tensor([input_key(x) for x in items], dtype=torch.int64)
    return Pool(items, keys, by_digit)


def media_pools(media: Media, split: str, cfg: ModelConfig, base: Path) -> dict[str, Pool]:
    """The split's media, decoded for `cfg`: image scans, audio clips and sentences."""
    raw = {"image": media.images[split], "audio": media.clips[split], "text": media.texts[split]}
    return {m: decode_pool(raw[m], cfg, m, base) for m in MODALITIES}


def change_speed(wave: torch.Tensor, factor: float) -> torch.Tensor:
    """The clip played `factor` times faster (tempo and pitch together, as a tape would),
    cropped or zero-padded back to its length."""
    x = wave.numpy()
    n = len(x)
    src = np.arange(n, dtype=np.float64) * factor  # where output sample i reads the input
    out = np.interp(src, np.arange(n), x, right=0.0).astype(np.float32)
    return torch.from_numpy(out)


class FreshTuples:
    """A TupleSource (models.train.data) of `n` tuples, all drawn once from `seed`: row i is a digit
    triple of `dataset` and a random medium of each digit. With `speed_jitter` s, row i's clip
    plays at a speed drawn from [1/(1+s), 1+s] (keys stay the clip's: same clip, same key)."""

    def __init__(
        self, pools: dict[str, Pool], dataset: str, n: int, seed: int, speed_jitter: float = 0.0
    ):
        rng = np.random.default_rng(seed)
        digits = digits_for(dataset, rng, n)  # (n, 3) in MODALITIES order
        self.pools = pools
        self.rows: dict[str, np.ndarray] = {}  # modality -> (n,) positions in its pool
        for j, m in enumerate(MODALITIES):
            sizes = np.array([len(p) for p in pools[m].by_digit])
            # A uniform medium of the row's digit: an offset into that digit's list.
            pick = (rng.random(n) * sizes[digits[:, j]]).astype(np.int64)
            self.rows[m] = np.array(
                [pools[m].by_digit[d][k] for d, k in zip(digits[:, j], pick, strict=True)],
                dtype=np.int64,
            )
        log_s = np.log1p(speed_jitter)
        self.speed = np.exp(rng.uniform(-log_s, log_s, n)) if speed_jitter else None

    def __len__(self) -> int:
        return len(self.rows["image"])

    def batch(self, index: Sequence[int]) -> tuple[dict[str, list[Any]], dict[str, torch.Tensor]]:
        items, keys = {}, {}
        for m, pool in self.pools.items():
            pos = self.rows[m][np.asarray(index, dtype=np.int64)]
            items[m] = [pool.items[p] for p in pos.tolist()]
            if m == "audio" and self.speed is not None:
                speeds = self.speed[np.asarray(index, dtype=np.int64)]
                items[m] = [change_speed(x, f) for x, f in zip(items[m], speeds, strict=True)]
            keys[m] = pool.keys[torch.from_numpy(pos)]
        return items, keys
