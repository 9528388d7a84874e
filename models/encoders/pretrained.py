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
- `train_layers`: 0 (the default) keeps the tower frozen: it runs outside the training step
  (models.train.loader says where) and its pooled features can be cached across epochs and runs
  (models.train.feature_cache); N fine-tunes the last N blocks (and what follows them), "all"
  the whole tower, which then runs in the trainable forward pass and is saved with the model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ModalityConfig
from models.encoders.audio import _read_wav
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
    """The model's directory: `name` itself, its snapshot in the local Hugging Face cache, or
    a directory of its name in $HCLIP_TOWERS_DIR (a model moved to another machine: a saved
    model names its towers by the paths they had where it was trained)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return _model_dir(path)
    moved = _in_towers_dir(path)
    if path.is_absolute() or name.startswith("."):
        if moved is not None:
            return moved
        raise PretrainedError(f"model directory {path} does not exist{_elsewhere(path)}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the local cache (or not a valid id): no network here
        if moved is not None:
            return moved
        raise PretrainedError(
            f"model {name!r} is neither a directory (beside the config, or from the working "
            f"directory) nor in the local Hugging Face cache, nor in HCLIP_TOWERS_DIR; "
            f"{_hint(name)}"
        ) from None


def _model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise PretrainedError(f"{path}: no config.json, not a transformers model directory")
    return path.resolve()


def _in_towers_dir(path: Path) -> Path | None:
    towers = os.environ.get("HCLIP_TOWERS_DIR")
    if not towers or not (Path(towers) / path.name).is_dir():
        return None
    return _model_dir(Path(towers) / path.name)


def _elsewhere(path: Path) -> str:
    towers = os.environ.get("HCLIP_TOWERS_DIR")
    if towers:
        return f", nor does {Path(towers) / path.name} (HCLIP_TOWERS_DIR)"
    return (
        f": fetch the tower once on a machine with access (`huggingface-cli download HUB_ID "
        f"--local-dir {path}`) or copy it there; for a model trained on another machine, set "
        f"HCLIP_TOWERS_DIR to a directory that holds it as {path.name}/"
    )


def _hint(name: str) -> str:
    return FETCH_HINT.format(name=name)


def identity(name: str) -> dict[str, Any]:
    """What the model fingerprint covers: the revision the cache or the config records and a
    hash of every file that defines the tower (weights, config, processor and tokenizer files),
    so a changed tower is another model and a moved or renamed one the same. The hash is read
    once per process and set of files (a tower's weights are GBs; fingerprints are asked for
    often)."""
    path = resolve(name)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    stats = tuple((str(f), st.st_size, st.st_mtime_ns, st.st_ino) for f in files
                  for st in [f.stat()])  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    revision = config.get("_commit_hash") or (path.name if path.parent.name == "snapshots" else "")
    return {"revision": revision, "files": _files_hash(str(path), stats)}


@functools.lru_cache(maxsize=64)
def _files_hash(root: str, stats: tuple[tuple[str, int, int, int], ...]) -> str:
    """sha256 over the files' relative names and bytes; `stats` (path, size, mtime, inode) is
    the cache key, so a changed file is read again."""
    h = hashlib.sha256()
    for f, *_ in stats:
        h.update(str(Path(f).relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def by_length(items: list[Any]) -> list[tuple[torch.Tensor, list[Any]]]:
    """The clips of each length with their positions in the batch, lengths in the order first
    seen: clips of one length run through a tower together, unpadded (Tower.__call__ says why)."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(items):
        groups.setdefault(len(x), []).append(i)
    return [(torch.tensor(where), [items[i] for i in where]) for where in groups.values()]


def in_batch_order(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Rows computed group by group ((positions, rows) each), back in the batch's order."""
    where = torch.cat([w for w, _ in parts])
    rows = torch.cat([r for _, r in parts])
    return rows[torch.argsort(where.to(rows.device))]


# A fine-tuned audio tower's batch: per clip length, the clips' positions and their inputs.
AudioGroups = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class Processor:
    """A tower's processor for one input kind, loaded without the model: the reader processes
    and DataLoader workers that only prepare inputs hold no copy of its weights."""

    processor: Any
    input: str
    sampling_rate: int | None
    max_length: int | None = None  # tokens: a sentence-transformers model's max_seq_length

    def __call__(self, items: list[Any]) -> dict[str, torch.Tensor]:
        """Decoded inputs -> the model's keyword arguments (a batch). Clips of unequal length
        are padded (with the attention mask where the processor gives one)."""
        if self.input == "text":
            return dict(self.processor(list(items), padding=True, truncation=True,
                                       max_length=self.max_length,
                                       return_tensors="pt"))  # fmt: skip
        if self.input == "image":  # decoded images are the processor's pixels already
            return {"pixel_values": torch.stack(list(items))}
        return dict(self.processor([x.numpy() for x in items], sampling_rate=self.sampling_rate,
                                   padding=True, return_tensors="pt",
                                   return_attention_mask=True))  # fmt: skip


@dataclass
class Tower:
    """A loaded model and its processor, for one input kind."""

    model: Any
    prep: Processor
    pooling: str

    @property
    def input(self) -> str:
        return self.prep.input

    def inputs(self, items: list[Any]) -> dict[str, torch.Tensor]:
        return self.prep(items)

    def forward(self, model: Any, inputs: dict[str, torch.Tensor]) -> Any:
        """The model's outputs for one input kind. A two-tower checkpoint (CLIP, SigLIP, CLAP:
        `get_image_features` and the like) runs only the tower of this input, and its projected
        output is the `{input}_embeds` that pooling 'auto' takes."""
        run_one = getattr(model, f"get_{self.input}_features", None)
        if run_one is None:
            return model(**inputs)
        out = run_one(**inputs)
        if isinstance(out, torch.Tensor):  # transformers before 5: the projection alone
            return SimpleNamespace(**{f"{self.input}_embeds": out})
        return SimpleNamespace(**{f"{self.input}_embeds": out.pooler_output,
                                  "last_hidden_state": out.last_hidden_state})  # fmt: skip

    def pooled(self, out: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, H) from the model's outputs, as `pooling` says."""
        if self.pooling in ("auto", "pooled"):
            for key in ("image_embeds", "text_embeds", "audio_embeds"):
                if getattr(out, key, None) is not None and self.pooling == "auto":
                    return torch.as_tensor(getattr(out, key))
            pooled = getattr(out, "pooler_output", None)
            if pooled is None and self.pooling == "pooled":  # a two-tower model's projection
                pooled = getattr(out, f"{self.input}_embeds", None)
            if pooled is not None:
                return torch.as_tensor(pooled)
            if self.pooling == "pooled":
                raise PretrainedError(
                    f"{type(self.model).__name__} has no pooled output: use pooling 'mean' or 'cls'"
                )
        hidden = getattr(out, "last_hidden_state", None)  # (B, T, H)
        if hidden is None:
            raise PretrainedError(
                f"{type(self.model).__name__} gives no hidden states for pooling "
                f"{self.pooling!r}: use pooling 'auto'"
            )
        if self.pooling == "cls":
            return torch.as_tensor(hidden[:, 0])
        mask = self._mask(inputs, hidden)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def _mask(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, 1): the positions holding real tokens or frames."""
        mask = inputs.get("attention_mask")
        if mask is None:
            return hidden.new_ones((*hidden.shape[:2], 1))
        if mask.shape[1] != hidden.shape[1]:  # audio: samples -> frames
            get = getattr(self.model, "_get_feature_vector_attention_mask", None)
            if get is None:
                return hidden.new_ones((*hidden.shape[:2], 1))
            mask = get(hidden.shape[1], mask)
        return mask[..., None].to(hidden.dtype)

    def __call__(self, items: list[Any]) -> torch.Tensor:
        """(B, H) pooled features, on the model's device. Audio runs in groups of clips of
        one length: a model that normalises over time (wav2vec 2.0 base) would otherwise give
        a clip features that depend on the longest clip in its batch."""
        if self.input != "audio" or len({len(x) for x in items}) <= 1:
            return self._run(items)
        return in_batch_order([(where, self._run(group)) for where, group in by_length(items)])

    def _run(self, items: list[Any]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) for k, v in self.inputs(items).items()}
        return self.pooled(self.forward(self.model, inputs), inputs)


_LOADED: dict[tuple[str, str, str], Tower] = {}
_PROCESSORS: dict[tuple[str, str], Processor] = {}
_LOCK = threading.Lock()


def load_tower(cfg: ModalityConfig) -> Tower:
    """The tower of a `transformers` modality, loaded once per process (frozen, in eval mode);
    a processor that does not fit the model or the input kind is a PretrainedError."""
    assert cfg.model is not None and cfg.input is not None
    key = (cfg.model, cfg.input, cfg.pooling)
    prep = load_processor(cfg)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = Tower(load_weights(cfg), prep, cfg.pooling)
        return _LOADED[key]


def load_processor(cfg: ModalityConfig) -> Processor:
    """The processor of a `transformers` modality, loaded once per process and checked against
    the model's config and the modality's input kind and sampling rate."""
    assert cfg.model is not None and cfg.input is not None
    key = (cfg.model, cfg.input)
    with _LOCK:
        if key not in _PROCESSORS:
            _PROCESSORS[key] = _load_processor(cfg)
        return _PROCESSORS[key]


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # one log line a load: ours
    hf_logging.disable_progress_bar()


def _unusable(cfg: ModalityConfig, exc: Exception) -> PretrainedError:
    return PretrainedError(
        f"modality input {cfg.input!r}: {cfg.model} has no usable {cfg.input} processor "
        f"or model ({_first_sentence(exc)})"
    )


def _load_processor(cfg: ModalityConfig) -> Processor:
    from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    assert cfg.model is not None and cfg.input is not None
    path = resolve(cfg.model)
    loader: dict[str, Any] = {
        "image": AutoImageProcessor,
        "audio": AutoFeatureExtractor,
        "text": AutoTokenizer,
    }
    _quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        processor = loader[cfg.input].from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise _unusable(cfg, exc) from None
    _check_fits(cfg, config, processor)
    rate = getattr(processor, "sampling_rate", None)
    if cfg.input == "audio" and rate is not None and rate != cfg.sample_rate:
        raise PretrainedError(
            f"{cfg.model} takes audio at {rate} Hz: set the modality's sample_rate to {rate} "
            f"(it is {cfg.sample_rate}), so that clips are resampled to it as they are decoded"
        )
    return Processor(processor, cfg.input, rate, _max_seq_length(path))


def load_weights(cfg: ModalityConfig) -> Any:
    """A new copy of the modality's model, frozen and in eval mode (not kept: load_tower keeps
    the process's shared frozen one; a fine-tuned tower is its own)."""
    from transformers import AutoModel

    assert cfg.model is not None
    path = resolve(cfg.model)
    _quiet_transformers()
    try:
        # Loading initialises weights before reading them: that must not draw from the RNG
        # a seeded run builds its maps with (else a model depends on what loaded before it)
        with torch.random.fork_rng(devices=[]):
            model = AutoModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise _unusable(cfg, exc) from None
    model.eval().requires_grad_(False)
    log.info("loaded %s (%s, %s input) from %s", cfg.model, type(model).__name__, cfg.input, path)
    return model


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


def features_dim(cfg: ModalityConfig, tower: Tower) -> int:
    """The width of the tower's pooled output, from one example input."""
    with torch.no_grad():
        return int(tower([example_input(cfg)]).shape[-1])


def example_input(cfg: ModalityConfig) -> Any:
    if cfg.input == "text":
        return "a first query"
    if cfg.input == "image":
        from PIL import Image

        return preprocess_image(Image.new("RGB", (32, 32), (127, 127, 127)), cfg)
    rate = load_processor(cfg).sampling_rate or 16000
    t = np.arange(rate // 4, dtype=np.float32) / rate
    return torch.from_numpy(0.1 * np.sin(2 * np.pi * 440.0 * t).astype(np.float32))


def decode_pretrained(
    value: Any, cfg: ModalityConfig, base_dir: Path | None, limits: InputLimits = DEFAULT_LIMITS
) -> Any:
    """A raw input of the modality's input kind -> what the tower's batch is made of: a string,
    an image's pixel tensor as its image processor makes it (resized, cropped, normalised: done
    here, in the reader processes and DataLoader workers, so that a decoded image has the
    model's input size rather than the photo's), or a mono waveform at the processor's rate
    (cropped to max_seconds)."""
    if cfg.input == "text":
        return decode_text(value, limits)
    if cfg.input == "image":
        image = decode_image_file(read_bytes(value, base_dir, "image", limits), limits, "RGB")
        return preprocess_image(image, cfg)
    data = read_bytes(value, base_dir, "audio", limits)
    # 10 ms past max_seconds: the resampling filter's reach, so the crop has no edge effect
    samples, total, rate = _read_wav(data, cfg, limits, margin_s=0.01)
    if total == 0:
        raise InputError("audio holds no samples")
    target = cfg.sample_rate
    n = min(math.ceil(cfg.max_seconds * target), max(1, round(total * target / rate)))
    if rate != target:
        samples = resample(samples, rate, target)
    return torch.from_numpy(np.ascontiguousarray(samples[:n], dtype=np.float32))


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """`x` at `target` Hz, low-pass filtered first (scipy's polyphase resampler): a pretrained
    speech or sound model heard its training audio resampled so, and a plain interpolation
    would fold what lies above target/2 (a 44.1 kHz recording's upper half) into its band."""
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return np.asarray(resample_poly(x, target // g, rate // g), dtype=np.float32)


def preprocess_image(image: Any, cfg: ModalityConfig) -> torch.Tensor:
    """An RGB PIL image -> (C, H, W) float32 pixels, by the tower's own image processor."""
    pixels = load_processor(cfg).processor(images=[image], return_tensors="pt")["pixel_values"]
    return torch.as_tensor(pixels[0], dtype=torch.float32).contiguous()


def pixels_bytes(cfg: ModalityConfig) -> int:
    """The size of one preprocessed image (models.encoders.decoded_bytes)."""
    example = example_input(cfg)
    return int(example.numel() * example.element_size())


class PretrainedFeatures:
    """The frozen tower as a featurizer: decoded inputs -> (B, H) float32 pooled features on
    the CPU, batched (loaded lazily in each process, e.g. each DataLoader worker). `place`
    runs the tower on a device, under autocast when `amp` is a dtype (index builds and the
    service: MultimodalModel.to_inference)."""

    def __init__(self, cfg: ModalityConfig):
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.amp: torch.dtype | None = None

    def place(self, device: torch.device, amp: torch.dtype | None) -> None:
        self.device, self.amp = device, amp
        load_tower(self.cfg).model.to(device)  # one copy per process, where it runs

    @torch.no_grad()  # not inference mode: training takes these features into autograd
    def __call__(self, items: list[Any]) -> torch.Tensor:
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

    def place(self, device: torch.device, amp: torch.dtype | None) -> None:
        if isinstance(self.featurizer, PretrainedFeatures):  # a trainable tower moves with us
            self.featurizer.place(device, amp)

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
