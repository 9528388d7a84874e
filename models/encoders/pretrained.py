"""`transformers`: a pretrained tower from Hugging Face `transformers` (any model on disk or in
the local Hugging Face cache), run by the model's own processor, pooled, then projected.

    {"kind": "transformers", "model": "DIR or hub id", "input": "image" | "audio" | "text",
     "pooling": "auto" | "pooled" | "mean" | "cls", "train_layers": 0 | N | "all",
     "map": "linear" | "mlp", "hidden": 256}

- Loading is offline (`local_files_only`): a model that is not on disk is an error naming it
  and how to fetch it on a machine with access.
- Inputs stay the raw forms the API takes: image bytes (any format Pillow reads) and WAV clips,
  decoded here under the same limits as the other kinds, and text; the processor
  (AutoImageProcessor, AutoFeatureExtractor at its own sampling rate, AutoTokenizer with
  truncation) makes the model's inputs.
- `pooling`: "auto" takes the model's projected output where it has one (CLIP's image/text
  embeddings), else its pooled output, else the mean of the last hidden state over the real
  tokens or frames; "pooled", "mean" and "cls" ask for one of these.
- `train_layers`: 0 (the default) keeps the tower frozen: it runs where records are decoded
  (DataLoader workers) and its pooled features can be cached across epochs and runs
  (models.train.feature_cache); N fine-tunes the last N blocks (and what follows them), "all"
  the whole tower, which then runs in the trainable forward pass and is saved with the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.audio import _read_wav, _resample_prefix
from models.encoders.base import Encoder, Featurizer
from models.encoders.image import decode_image_file
from models.encoders.media import read_bytes
from models.encoders.text_input import decode_text
from models.errors import PretrainedError
from models.limits import DEFAULT_LIMITS, InputError, InputLimits

log = logging.getLogger(__name__)
FETCH_HINT = (
    "fetch it once on a machine with access (`huggingface-cli download {name}` or "
    "`AutoModel.from_pretrained('{name}').save_pretrained(DIR)` with its processor) and give "
    "the directory as `model`"
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


def resolve(name: str) -> Path:
    """The model's directory: `name` itself, or its snapshot in the local Hugging Face cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PretrainedError(f"{path}: no config.json, not a transformers model directory")
        return path.resolve()
    if path.is_absolute() or name.startswith("."):
        raise PretrainedError(f"model directory {path} does not exist; {_hint(name)}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the local cache (or not a valid id): no network here
        raise PretrainedError(
            f"model {name!r} is neither a directory nor in the local Hugging Face cache; "
            f"{_hint(name)}"
        ) from None


def _hint(name: str) -> str:
    return FETCH_HINT.format(name=name)


def identity(name: str) -> dict[str, Any]:
    """What the model fingerprint covers: the name as configured, the revision the cache or the
    config records, and a hash of every file that defines the tower (weights, config, processor
    and tokenizer files), so a changed tower is another model."""
    path = resolve(name)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    config = json.loads((path / "config.json").read_text())
    revision = config.get("_commit_hash") or (path.name if path.parent.name == "snapshots" else "")
    return {"model": name, "revision": revision, "files": h.hexdigest()[:16]}


@dataclass
class Tower:
    """A loaded model and its processor, for one input kind."""

    model: Any
    processor: Any
    input: str
    pooling: str
    sampling_rate: int | None
    max_length: int | None = None  # tokens: a sentence-transformers model's max_seq_length

    def inputs(self, items: list[Any]) -> dict[str, torch.Tensor]:
        """Decoded inputs -> the model's keyword arguments (a batch)."""
        if self.input == "text":
            return dict(self.processor(list(items), padding=True, truncation=True,
                                       max_length=self.max_length,
                                       return_tensors="pt"))  # fmt: skip
        if self.input == "image":
            return dict(self.processor(images=list(items), return_tensors="pt"))
        return dict(self.processor([x.numpy() for x in items], sampling_rate=self.sampling_rate,
                                   padding=True, return_tensors="pt",
                                   return_attention_mask=True))  # fmt: skip

    def pooled(self, out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, H) from the model's outputs, as `pooling` says."""
        if self.pooling in ("auto", "pooled"):
            for key in ("image_embeds", "text_embeds", "audio_embeds"):
                if getattr(out, key, None) is not None and self.pooling == "auto":
                    return torch.as_tensor(getattr(out, key))
            pooled = getattr(out, "pooler_output", None)
            if pooled is not None:
                return torch.as_tensor(pooled)
            if self.pooling == "pooled":
                raise PretrainedError(
                    f"{type(self.model).__name__} has no pooled output: use pooling 'mean' or 'cls'"
                )
        hidden = out.last_hidden_state  # (B, T, H)
        if self.pooling == "cls":
            return torch.as_tensor(hidden[:, 0])
        mask = self._mask(inputs, hidden)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def _mask(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 1): the positions holding real tokens or frames."""
        mask = inputs.get("attention_mask")
        if mask is None:
            return torch.ones((*hidden.shape[:2], 1), dtype=hidden.dtype)
        if mask.shape[1] != hidden.shape[1]:  # audio: samples -> frames
            get = getattr(self.model, "_get_feature_vector_attention_mask", None)
            if get is None:
                return torch.ones((*hidden.shape[:2], 1), dtype=hidden.dtype)
            mask = get(hidden.shape[1], mask)
        return mask[..., None].to(hidden.dtype)

    def __call__(self, items: list[Any]) -> torch.Tensor:
        inputs = self.inputs(items)
        return self.pooled(self.model(**inputs), inputs)


_LOADED: dict[tuple[str, str, str], Tower] = {}
_LOCK = threading.Lock()


def load_tower(cfg: ModalityConfig) -> Tower:
    """The tower of a `transformers` modality, loaded once per process (frozen, in eval mode);
    a processor that does not fit the model or the input kind is a PretrainedError."""
    assert cfg.model is not None and cfg.input is not None
    key = (cfg.model, cfg.input, cfg.pooling)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(cfg)
        return _LOADED[key]


def _load(cfg: ModalityConfig) -> Tower:
    from transformers import (
        AutoConfig,
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoModel,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    assert cfg.model is not None and cfg.input is not None
    path = resolve(cfg.model)
    loader: dict[str, Any] = {
        "image": AutoImageProcessor,
        "audio": AutoFeatureExtractor,
        "text": AutoTokenizer,
    }
    hf_logging.set_verbosity_error()  # one log line a load: ours
    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        processor = loader[cfg.input].from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise PretrainedError(
            f"modality input {cfg.input!r}: {cfg.model} has no usable {cfg.input} processor "
            f"or model ({_first_sentence(exc)})"
        ) from None
    _check_fits(cfg, config, processor)
    model.eval().requires_grad_(False)
    rate = getattr(processor, "sampling_rate", None)
    if cfg.input == "audio" and rate is not None and rate != cfg.sample_rate:
        raise PretrainedError(
            f"{cfg.model} takes audio at {rate} Hz: set the modality's sample_rate to {rate} "
            f"(it is {cfg.sample_rate}), so that clips are resampled to it as they are decoded"
        )
    log.info("loaded %s (%s, %s input) from %s", cfg.model, type(model).__name__, cfg.input, path)
    return Tower(model, processor, cfg.input, cfg.pooling, rate, _max_seq_length(path))


def _max_seq_length(path: Path) -> int | None:
    """The length a sentence-transformers model was trained to cut its inputs at, if it is one."""
    config = path / "sentence_bert_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if isinstance(value, int) else None


def _first_sentence(exc: Exception) -> str:
    """The start of a library's message (some list every model type they know)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split(". ")[0][:300]


def _check_fits(cfg: ModalityConfig, config: Any, processor: Any) -> None:
    """The processor and the model must take the same input kind as the modality."""
    kind = type(processor).__name__.lower()
    processor_input = "text" if "tokenizer" in kind else "audio" if "feature" in kind else "image"
    if processor_input != cfg.input:
        raise PretrainedError(
            f"{cfg.model}: its processor ({type(processor).__name__}) takes {processor_input}, "
            f"but the modality's input is {cfg.input!r}"
        )
    model_type = str(getattr(config, "model_type", ""))
    audio_models = ("wav2vec2", "hubert", "wavlm", "whisper", "clap", "data2vec-audio", "audio")
    is_audio = any(a in model_type for a in audio_models)
    if (cfg.input == "audio") != is_audio:
        raise PretrainedError(
            f"{cfg.model}: a {model_type!r} model does not take {cfg.input} input with this "
            f"processor ({type(processor).__name__})"
        )


def features_dim(cfg: ModalityConfig) -> int:
    """The width of the pooled output, from one example input."""
    tower = load_tower(cfg)
    with torch.no_grad():
        return int(tower([example_input(cfg)]).shape[-1])


def example_input(cfg: ModalityConfig) -> Any:
    if cfg.input == "text":
        return "a first query"
    if cfg.input == "image":
        from PIL import Image

        return Image.new("RGB", (32, 32), (127, 127, 127))
    rate = load_tower(cfg).sampling_rate or 16000
    t = np.arange(rate // 4, dtype=np.float32) / rate
    return torch.from_numpy(0.1 * np.sin(2 * np.pi * 440.0 * t).astype(np.float32))


def decode_pretrained(
    value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits = DEFAULT_LIMITS
) -> Any:
    """A raw input of the modality's input kind -> what its processor takes: a string, an RGB
    PIL image, or a mono waveform at the processor's rate (cropped to max_seconds)."""
    if cfg.input == "text":
        return decode_text(value, limits)
    if cfg.input == "image":
        return decode_image_file(read_bytes(value, base_dir, "image", limits), limits, "RGB")
    data = read_bytes(value, base_dir, "audio", limits)
    samples, total, rate = _read_wav(data, cfg, limits)
    if total == 0:
        raise InputError("audio holds no samples")
    target = cfg.sample_rate
    n = min(math.ceil(cfg.max_seconds * target), max(1, round(total * target / rate)))
    if rate != target:
        samples = _resample_prefix(samples, total, rate, target, n)
    return torch.from_numpy(np.ascontiguousarray(samples[:n], dtype=np.float32))


class PretrainedFeatures:
    """The frozen tower as a featurizer: decoded inputs -> (B, H) pooled features, batched
    (loaded lazily in each process, e.g. each DataLoader worker)."""

    def __init__(self, cfg: ModalityConfig):
        self.cfg = cfg

    @torch.no_grad()  # not inference mode: training takes these features into autograd
    def __call__(self, items: list[Any]) -> torch.Tensor:
        return load_tower(self.cfg)(list(items)).float()


class PretrainedInputs:
    """A tower being fine-tuned runs in the forward pass: the featurizer only prepares its
    inputs (tokens, pixels, padded waveforms)."""

    def __init__(self, cfg: ModalityConfig):
        self.cfg = cfg

    def __call__(self, items: list[Any]) -> dict[str, torch.Tensor]:
        return load_tower(self.cfg).inputs(list(items))


def trainable_blocks(model: nn.Module, n: int | None) -> None:
    """Freeze `model`, then unfreeze its last `n` blocks (the ModuleList holding the most
    weights: the transformer layers, not a stack of convolutions before them) and every module
    that comes after them (final norms, poolers, projections); n None: all of it."""
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
    for m_name, module in model.named_modules():
        if m_name in order[after:] and not m_name.startswith(name + "."):
            module.requires_grad_(True)


class PretrainedEncoder(Encoder):
    """The tower (frozen as a featurizer, or partly trainable as a submodule), then the map to
    the latent d and the L2 norm."""

    def __init__(self, cfg: ModalityConfig, latent_dim: int):
        super().__init__(cfg)
        width = features_dim(cfg)
        self.tower: nn.Module | None = None
        if cfg.train_layers == 0:
            self.featurizer = PretrainedFeatures(cfg)
        else:
            import copy

            tower = load_tower(cfg)
            self.tower = copy.deepcopy(tower.model)  # its own, trainable copy: saved with us
            trainable_blocks(self.tower, None if cfg.train_layers == -1 else cfg.train_layers)
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

    def forward(self, batch: Any) -> torch.Tensor:
        if self.tower is None:
            feats = batch
        else:
            tower = load_tower(self.cfg)
            mine = Tower(self.tower, tower.processor, tower.input, tower.pooling,
                         tower.sampling_rate, tower.max_length)  # fmt: skip
            feats = mine.pooled(self.tower(**batch), batch)
        return nn.functional.normalize(self.map(feats.float()), dim=-1)
