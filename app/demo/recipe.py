"""The demo's training recipe: encoders, budget and order, the same for both heads.

Why it is built this way (held-out hit@1 on the demo's data, measured by trying each
alternative while the recipe was built; docs/demo/results.md has what the recipe gives):
- Every training tuple is drawn afresh (app/demo/tuples.py) instead of cycling a fixed set of a
  few thousand: the media allow some 10^8 interaction tuples, and a fixed set can be memorised.
- From random encoders the interaction does not train in any budget the demo can afford: the
  loss stays at log(batch) (a uniform softmax) while each modality alone says nothing about
  the others, and at initialisation every image's embedding lies within cosine 0.9999 of every
  other's. Batch 32 or 64, learning rate 0.002 or 0.005, omega started 4x larger or smaller,
  logit scale 1, 14 or 30, latent width 16 or 64, projections centred on the data: none left
  the plateau in 750 steps. So each head first learns `shared` (one digit in all three
  modalities, a pairwise signal), and its `interaction` model starts from those encoders. The
  interaction itself is learned from interaction tuples alone.
- In the interaction stage the convolutions stay as `shared` trained them and only the layers
  above them learn: fine-tuned whole, the audio encoder lost held-out voices (nearest-class
  accuracy 0.99-1.00 before, 0.97 after) and the audio views fell to 0.90-0.96 hit@1.
  Frozen convolutions also cost a forward pass only, so the stage takes 1,000 steps cheaply.
- Audio limits held-out retrieval (unseen voices): 12 training voices and every clip played
  at a random speed (+-15%) took the worst audio view from 0.90-0.97 to 0.975-0.99 over seeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

HEADS = ("hclip", "sum_of_pairs")


@dataclass(frozen=True)
class Stage:
    """One model per head: trained on `dataset` for `steps`. With `warm_start`, its encoders
    start as the same head's model of that dataset, and with `freeze_convs` their convolutions
    stay as they were: only the layers above them (and the head) train."""

    dataset: str
    steps: int
    warm_start: str | None = None
    freeze_convs: bool = False
    lr: float | None = None  # None: the recipe's


@dataclass(frozen=True)
class Recipe:
    stages: tuple[Stage, ...] = (
        Stage("shared", 300),
        Stage("interaction", 1000, warm_start="shared", freeze_convs=True),
    )
    batch_size: int = 64
    speed_jitter: float = 0.15
    lr: float = 0.002
    latent_dim: int = 64
    # One torch thread per training process, the two heads in two processes (small convolutions
    # split poorly over threads), and a fixed thread count keeps a machine's runs identical.
    threads: int = 1

    def stage(self, dataset: str) -> Stage:
        return next(s for s in self.stages if s.dataset == dataset)

    def scaled(self, factor: float) -> Recipe:
        """The same recipe with `factor` times the steps (the tests' reduced size)."""
        stages = tuple(replace(s, steps=max(1, round(s.steps * factor))) for s in self.stages)
        return replace(self, stages=stages)

    def to_dict(self) -> dict[str, Any]:
        """As JSON gives it back (lists, not tuples), so that a stored recipe compares equal."""
        return dict(json.loads(json.dumps(asdict(self))))


def model_config(recipe: Recipe, head: str) -> dict[str, Any]:
    """The architecture, as a models.config dict: small CNNs for 16 x 16 scans and 0.8 s of
    8 kHz audio, a head over the frozen MiniLM for text."""
    return {
        "modalities": {
            "image": {"kind": "image", "image_size": 16, "conv_width": 16, "hidden": 128},
            "audio": {
                "kind": "audio",
                "sample_rate": 8000,
                "max_seconds": 0.8,
                "n_mels": 24,
                "hop_ms": 20.0,
                "conv_width": 16,
                "hidden": 128,
            },
            "text": {"kind": "text", "hidden": 128},
        },
        "head": head,
        "latent_dim": recipe.latent_dim,
    }


def train_config(recipe: Recipe, stage: Stage, seed: int) -> dict[str, Any]:
    """models.config's `train` block: one pass over `steps x batch` fresh tuples."""
    return {
        "records": "(drawn afresh by app/demo/tuples.py)",
        "epochs": 1,
        "batch_size": recipe.batch_size,
        "lr": stage.lr or recipe.lr,
        "seed": seed,
        "num_threads": recipe.threads,
        "precision": "fp32",
        "device": "cpu",
    }
