"""`transformers`: a pretrained tower from Hugging Face `transformers` (any model on disk or in
the local Hugging Face cache), run by the model's own processor, pooled, then projected.

    {"kind": "transformers", "model": "DIR or hub id", "input": "image" | "audio" | "text",
     "pooling": "auto" | "pooled" | "mean" | "cls", "train_layers": 0 | N | "all",
     "map": "linear" | "mlp", "hidden": 256}

- Loading is offline (`local_files_only`): a model that is not on disk is an error naming it
  and how to fetch it on a machine with access (models.encoders.tower_files finds its files,
  models.encoders.towers loads it).
- Inputs stay the raw forms the API takes: image bytes (any format Pillow reads) and WAV clips,
  decoded under the same limits as the other kinds (models.encoders.tower_inputs), and text;
  the processor (AutoImageProcessor, AutoFeatureExtractor at its own sampling rate,
  AutoTokenizer with truncation) makes the model's inputs.
- `pooling`: "auto" takes the model's projected output where it has one (CLIP's image/text
  embeddings), else its pooled output, else the mean of the last hidden state over the real
  tokens or frames; "pooled", "mean" and "cls" ask for one of these.
- `train_layers`: 0 (the default) keeps the tower frozen: it runs outside the training step
  (models.train.loader says where) and its pooled features can be cached across epochs and runs
  (models.train.feature_cache); N fine-tunes the last N blocks (and what follows them), "all"
  the whole tower, which then runs in the trainable forward pass and is saved with the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.base import Encoder, Featurizer
from models.encoders.clip_groups import AudioGroups, by_length, in_batch_order
from models.encoders.onnx_runtime import OnnxTower, load_onnx_tower
from models.encoders.runtime import TORCH, Runtime
from models.encoders.tower_inputs import decode_pretrained, example_input
from models.encoders.towers import Tower, load_processor, load_tower, load_weights
from models.errors import PretrainedError
from models.limits import InputLimits


def features_dim(cfg: ModalityConfig, tower: Tower) -> int:
    """The width of the tower's pooled output, from one example input."""
    with torch.no_grad():
        return int(tower([example_input(cfg)]).shape[-1])


class PretrainedFeatures:
    """The frozen tower as a featurizer: decoded inputs -> (B, H) float32 pooled features on
    the CPU, batched (loaded lazily in each process, e.g. each DataLoader worker). `place`
    runs the tower on a device, under autocast when `amp` is a dtype, or under another runtime
    (index builds and the service: MultimodalModel.to_inference)."""

    def __init__(self, cfg: ModalityConfig):
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.amp: torch.dtype | None = None
        self.onnx: OnnxTower | None = None

    def place(
        self, device: torch.device, amp: torch.dtype | None, runtime: Runtime = TORCH
    ) -> None:
        self.device, self.amp = device, amp
        if runtime.onnx:
            self.onnx = load_onnx_tower(self.cfg, runtime)  # exported now, not at a query
        else:
            self.onnx = None
            load_tower(self.cfg).model.to(device)  # one copy per process, where it runs

    @torch.no_grad()  # not inference mode: training takes these features into autograd
    def __call__(self, items: list[Any]) -> torch.Tensor:
        if self.onnx is not None:
            return self.onnx(list(items))
        tower = load_tower(self.cfg)
        if self.device.type == "cpu" and self.amp is None:
            # .cpu(): the process's tower may have been placed elsewhere (training's, on a GPU)
            return tower(list(items)).float().cpu()
        with torch.autocast(self.device.type, self.amp, enabled=self.amp is not None):
            return tower(list(items)).float().cpu()


class PretrainedInputs:
    """A tower being fine-tuned runs in the forward pass: the featurizer only prepares its
    inputs (tokens, pixels, padded waveforms)."""

    def __init__(self, cfg: ModalityConfig):
        self.cfg = cfg

    def __call__(self, items: list[Any]) -> dict[str, torch.Tensor] | AudioGroups:
        prep, items = load_processor(self.cfg), list(items)
        if prep.input != "audio":
            return prep(items)
        return [(where, prep(group)) for where, group in by_length(items)]


# A two-tower checkpoint's parts for one input: (tower, projection) attribute names.
TWO_TOWER_PARTS = {
    "image": ("vision_model", "visual_projection"),
    "text": ("text_model", "text_projection"),
    "audio": ("audio_model", "audio_projection"),
}


def trainable_part(model: nn.Module, kind: str, n: int | None) -> None:
    """Freeze `model`, then unfreeze what fine-tuning trains for input `kind`: in a two-tower
    checkpoint (CLIP, CLAP, SigLIP) only that input's tower and its projection, else the whole
    model; within it the last `n` blocks and what follows them (n None: all of it)."""
    model.requires_grad_(False)
    tower_name, projection = TWO_TOWER_PARTS[kind]
    if getattr(model, f"get_{kind}_features", None) is None or not hasattr(model, tower_name):
        trainable_blocks(model, n)
        return
    trainable_blocks(getattr(model, tower_name), n)
    head = getattr(model, projection, None)
    if isinstance(head, nn.Module):
        head.requires_grad_(True)


def trainable_blocks(model: nn.Module, n: int | None) -> None:
    """Freeze `model`, then unfreeze its last `n` blocks (the ModuleList holding the most
    weights: the transformer layers, not a stack of convolutions before them), the norms beside
    them (a final norm may be registered before the blocks it follows: wav2vec 2.0's stable
    layer-norm variants) and every module that comes after them (final norms, poolers,
    projections); n None: all of it."""
    if n is None:
        model.requires_grad_(True)
        return
    model.requires_grad_(False)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise PretrainedError(f"{type(model).__name__}: no layer list to fine-tune in part")
    name, layers = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    if n > len(layers):
        raise PretrainedError(
            f"train_layers {n}: {type(model).__name__} has {len(layers)} blocks ({name})"
        )
    for block in list(layers)[len(layers) - n :]:
        block.requires_grad_(True)
    order = [m_name for m_name, _ in model.named_modules()]
    after = order.index(name) + len(list(layers.named_modules()))
    parent = name.rpartition(".")[0]
    for m_name, module in model.named_modules():
        follows = m_name in order[after:] and not m_name.startswith(name + ".")
        beside = m_name.rpartition(".")[0] == parent and isinstance(module, nn.LayerNorm)
        if follows or beside:
            module.requires_grad_(True)


class PretrainedEncoder(Encoder):
    """The tower (frozen as a featurizer, or partly trainable as a submodule), then the map to
    the latent d and the L2 norm."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg)
        self.tower: nn.Module | None = None
        if cfg.train_layers == 0:
            self.featurizer = PretrainedFeatures(cfg)
            width = features_dim(cfg, load_tower(cfg))
        else:
            # Its own, trainable copy, saved with us: the process loads no frozen one beside it.
            model = load_weights(cfg)
            width = features_dim(cfg, Tower(model, load_processor(cfg), cfg.pooling))
            n = None if cfg.train_layers == -1 else cfg.train_layers
            assert cfg.input is not None
            trainable_part(model, cfg.input, n)
            self.tower = model
            self.featurizer = PretrainedInputs(cfg)  # type: ignore[assignment]
        if cfg.map == "mlp":
            self.map: nn.Module = nn.Sequential(
                nn.Linear(width, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, latent_dim)
            )
        else:
            self.map = nn.Linear(width, latent_dim)

    @staticmethod
    def decode(value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits) -> Any:
        return decode_pretrained(value, cfg, base_dir, limits)

    @staticmethod
    def example(cfg: ModalityConfig) -> Any:
        return example_input(cfg)

    @staticmethod
    def featurizer_for(cfg: ModalityConfig) -> Featurizer:
        if cfg.train_layers == 0:
            return PretrainedFeatures(cfg)
        return PretrainedInputs(cfg)  # type: ignore[return-value]

    def place(
        self, device: torch.device, amp: torch.dtype | None, runtime: Runtime = TORCH
    ) -> None:
        # a trainable tower moves with us, and stays on torch: its weights are the model's
        if isinstance(self.featurizer, PretrainedFeatures):
            self.featurizer.place(device, amp, runtime)

    def forward(self, batch: Any) -> torch.Tensor:
        if self.tower is None:
            feats = batch
        else:
            mine = Tower(self.tower, load_processor(self.cfg), self.cfg.pooling)
            if isinstance(batch, list):  # AudioGroups: each length's clips, then back in order
                feats = in_batch_order(
                    [(w, mine.pooled(mine.forward(self.tower, x), x)) for w, x in batch]
                )
            else:
                feats = mine.pooled(mine.forward(self.tower, batch), batch)
        return nn.functional.normalize(self.map(feats.float()), dim=-1)
