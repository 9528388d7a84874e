"""A pretrained tower loaded from its files (models.encoders.tower_files): its model and its
processor, each loaded once per process, offline, and checked against the modality."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from models.config import ModalityConfig
from models.encoders.clip_groups import by_length, in_batch_order
from models.encoders.tower_files import resolve
from models.errors import PretrainedError

log = logging.getLogger(__name__)


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


def release_tower(cfg: ModalityConfig) -> None:
    """Forget the process's torch copy of the tower (one under another runtime replaces it);
    load_tower loads it again if it is asked for."""
    with _LOCK:
        _LOADED.pop((str(cfg.model), str(cfg.input), cfg.pooling), None)


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
