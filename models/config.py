"""Model and training configuration: small dataclasses that round-trip to JSON.

Every validation error names the offending field by its JSON path (``modalities.a.dim``), so a
user can find it in the config file without reading a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from models.limits import DEFAULT_LIMITS, InputLimits
from models.records import near_miss

ENCODER_KINDS = ("vector", "embedding", "text", "image", "audio", "plugin", "transformers")
PRETRAINED_INPUTS = ("image", "audio", "text")
POOLINGS = ("auto", "pooled", "mean", "cls")
PRETRAINED_MAPS = ("linear", "mlp")
HEADS = ("hclip", "sum_of_pairs", "symile", "clip")
LOSSES = ("full_conditional", "pairwise")
EMBEDDING_MAPS = ("none", "linear")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
# Train settings that may change between a checkpoint and its resumption: they alter how fast
# a run goes, never where it ends.
RESUMABLE_CHANGES = (
    "num_workers",
    "num_threads",
    "log_every",
    "checkpoint_every",
    "device",
    "log_dir",
)
KEEPS = ("last", "best")
VALIDATION_UNITS = ("epochs", "steps")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def _req(obj: dict[str, Any], key: str, path: str) -> Any:
    if key not in obj:
        raise ConfigError(f"{path}{key}: required field is missing")
    return obj[key]


def _int(value: Any, path: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _float(value: Any, path: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{path}: must be a finite {'positive ' if positive else ''}number")
    return float(value)


def _check_keys(
    obj: dict[str, Any],
    allowed: set[str],
    path: str,
    own: tuple[str, Collection[str]] | None = None,
) -> None:
    """Every key is one of `allowed`; an error suggests the nearest one and lists them, or
    with `own` (what, its keys) only the keys of what the object is: `kind 'text'`."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        what, names = ("allowed", sorted(allowed)) if own is None else (f"{own[0]} takes", own[1])
        raise ConfigError(
            f"{path}{unknown[0]}: unknown field{near_miss(unknown[0], names)} "
            f"({what}: {', '.join(names)})"
        )


def _fraction(value: Any, path: str) -> float:
    x = _float(value, path, positive=False)
    if not 0.0 <= x < 1.0:
        raise ConfigError(f"{path}: must be in [0, 1), got {value!r}")
    return x


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise ConfigError(f"{path}: expected one of {', '.join(choices)}, got {value!r}")
    return str(value)


# What each kind reads, besides `kind`: what an unknown key's error lists for that kind.
KIND_KEYS = {
    "vector": ("dim", "hidden"),
    "embedding": ("dim", "map"),
    "text": ("hidden",),
    "image": ("hidden", "conv_width", "image_size", "channels"),
    "audio": ("hidden", "conv_width", "sample_rate", "max_seconds", "n_mels", "hop_ms"),
    "plugin": ("plugin", "weights", "options", "hidden"),
    "transformers": (
        "model", "input", "pooling", "train_layers", "map", "hidden", "sample_rate", "max_seconds"
    ),
}  # fmt: skip

# Keys that only one kind takes: anywhere else they are a mistake worth naming.
KIND_ONLY_KEYS = {
    "map": ("embedding", "transformers"),
    "model": ("transformers",),
    "input": ("transformers",),
    "pooling": ("transformers",),
    "train_layers": ("transformers",),
    "plugin": ("plugin",),
    "weights": ("plugin",),
    "options": ("plugin",),
}


@dataclass(frozen=True)
class ModalityConfig:
    """One modality: its input kind and the kind's preprocessing parameters."""

    kind: str
    dim: int | None = None  # vector, embedding: input length
    hidden: int = 256  # width of the trainable layers before the projection
    conv_width: int = 32  # image, audio: channels of the first conv block (the second has 2x)
    image_size: int = 32  # image: inputs are resized to image_size x image_size
    channels: int = 1  # image: 1 (grey) or 3 (RGB)
    sample_rate: int = 16000  # audio: waveforms are resampled to this rate
    max_seconds: float = 1.0  # audio: clips are cropped or zero-padded to this length
    n_mels: int = 40  # audio
    hop_ms: float = 10.0  # audio: spectrogram frame step
    map: str = "none"  # embedding: "linear" learns a map from dim to latent_dim
    plugin: str | None = None  # plugin: the entry point's name in the group hclip.encoders
    weights: str | None = None  # plugin: the tower's safetensors file
    options: dict[str, Any] = field(default_factory=dict)  # plugin: checked by the plugin
    model: str | None = None  # transformers: a model directory or a hub id in the local cache
    input: str | None = None  # transformers: image, audio or text
    pooling: str = "auto"  # transformers: models.encoders.pretrained
    train_layers: int = 0  # transformers: blocks fine-tuned from the top; -1 for all of them

    @property
    def raw_form(self) -> str:
        """What the API takes for this modality: image, audio, text, vector or embedding (a
        `transformers` tower takes its `input`; a plugin gives "plugin": its inputs are its own)."""
        return (self.input or self.kind) if self.kind == "transformers" else self.kind

    @staticmethod
    def from_dict(obj: Any, path: str, base_dir: Path | None = None) -> ModalityConfig:
        """`base_dir` resolves a relative plugin `weights` path (the config file's directory,
        or the model directory); without it the path is kept as written and not checked."""
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}: expected an object with a 'kind'")
        allowed = {f for f in ModalityConfig.__dataclass_fields__}
        kind_value = obj.get("kind")
        own = KIND_KEYS.get(kind_value) if isinstance(kind_value, str) else None
        kind_keys = None if own is None else (f"kind {kind_value!r}", ("kind", *own))
        _check_keys(obj, allowed, path + ".", kind_keys)
        kind = _req(obj, "kind", path + ".")
        if kind not in ENCODER_KINDS:
            raise ConfigError(
                f"{path}.kind: unknown encoder kind {kind!r} (known: {', '.join(ENCODER_KINDS)})"
            )
        for key, kinds in KIND_ONLY_KEYS.items():
            if key in obj and kind not in kinds:
                raise ConfigError(f"{path}.{key}: only {' and '.join(kinds)} modalities take it")
        kw: dict[str, Any] = {"kind": kind}
        if kind in ("vector", "embedding"):
            kw["dim"] = _int(_req(obj, "dim", path + "."), f"{path}.dim")
        elif "dim" in obj:
            raise ConfigError(f"{path}.dim: only 'vector' and 'embedding' modalities take a dim")
        if kind == "embedding":
            kw["map"] = _choice(obj.get("map", "none"), EMBEDDING_MAPS, f"{path}.map")
        if kind == "transformers":
            kw.update(_pretrained_fields(obj, path, base_dir))
        if kind == "plugin":
            kw.update(_plugin_fields(obj, path, base_dir))
        for name in ("hidden", "image_size", "sample_rate", "n_mels", "conv_width"):
            if name in obj:
                low = 8 if name in ("image_size", "sample_rate", "n_mels") else 1
                kw[name] = _int(obj[name], f"{path}.{name}", minimum=low)
        if "channels" in obj:
            kw["channels"] = _int(obj["channels"], f"{path}.channels")
            if kw["channels"] not in (1, 3):
                raise ConfigError(f"{path}.channels: must be 1 or 3")
        for name in ("max_seconds", "hop_ms"):
            if name in obj:
                kw[name] = _float(obj[name], f"{path}.{name}")
        return ModalityConfig(**kw)

    def to_dict(self) -> dict[str, Any]:
        # Only the kind's own fields, defaults left out: a config written before a field
        # existed reads back, and hashes (checkpoint.fingerprint), exactly as it did.
        defaults = ModalityConfig(kind=self.kind)
        relevant = {
            "vector": ("dim", "hidden"),
            "embedding": ("dim", "map"),
            "text": ("hidden",),
            "image": ("hidden", "image_size", "channels", "conv_width"),
            "audio": ("hidden", "sample_rate", "max_seconds", "n_mels", "hop_ms", "conv_width"),
            "plugin": ("plugin", "weights", "options", "hidden"),
            "transformers": (
                "model",
                "input",
                "pooling",
                "train_layers",
                "map",
                "hidden",
                "sample_rate",
                "max_seconds",
            ),
        }[self.kind]
        always = ("dim", "plugin", "weights", "options", "model", "input")
        out: dict[str, Any] = {"kind": self.kind}
        for name in relevant:
            value = getattr(self, name)
            if name in always or value != getattr(defaults, name):
                out[name] = dict(value) if isinstance(value, dict) else value
        if out.get("train_layers") == -1:
            out["train_layers"] = "all"
        return out


def _pretrained_fields(obj: dict[str, Any], path: str, base_dir: Path | None) -> dict[str, Any]:
    """`model` (a directory or a hub id), `input`, and optionally `pooling`, `train_layers` (0,
    N or "all") and `map` (linear, or mlp through `hidden`). The model itself is looked up
    where the encoder is built (models.encoders.pretrained), offline."""
    name = _req(obj, "model", path + ".")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.model: expected a model directory or a Hugging Face hub id")
    if base_dir is not None and (base_dir / name).is_dir():  # a directory beside the config
        name = str((base_dir / name).resolve())
    out: dict[str, Any] = {
        "model": name,
        "input": _choice(_req(obj, "input", path + "."), PRETRAINED_INPUTS, f"{path}.input"),
        "pooling": _choice(obj.get("pooling", "auto"), POOLINGS, f"{path}.pooling"),
        "map": _choice(obj.get("map", "linear"), PRETRAINED_MAPS, f"{path}.map"),
    }
    layers = obj.get("train_layers", 0)
    if layers == "all":
        out["train_layers"] = -1
    elif isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0:
        out["train_layers"] = layers
    else:
        raise ConfigError(f"{path}.train_layers: expected 0, a number of blocks or 'all'")
    if out["input"] == "audio" and "max_seconds" not in obj:
        out["max_seconds"] = 10.0  # a clip for a speech or sound model, not a spoken digit
    return out


def _plugin_fields(obj: dict[str, Any], path: str, base_dir: Path | None) -> dict[str, Any]:
    """`plugin` names an installed entry point, `weights` a file, `options` what the plugin
    checks: the plugin itself is looked up, and checks its options, where the model is built
    (models.plugins.resolve_options)."""
    name = _req(obj, "plugin", path + ".")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.plugin: expected the name of an installed encoder plugin")
    weights = _req(obj, "weights", path + ".")
    if not isinstance(weights, str) or not weights:
        raise ConfigError(f"{path}.weights: expected the path of a safetensors file")
    if base_dir is not None and not Path(weights).is_absolute():
        weights = str((base_dir / weights).resolve())
    if Path(weights).is_absolute() and not Path(weights).is_file():
        raise ConfigError(f"{path}.weights: plugin {name!r} weights file not found: {weights}")
    options = obj.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{path}.options: expected an object")
    return {"plugin": name, "weights": weights, "options": dict(options)}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture: modalities (in a fixed, sorted order), head and latent width."""

    modalities: dict[str, ModalityConfig]
    head: str = "hclip"
    latent_dim: int = 64

    @property
    def names(self) -> list[str]:
        return sorted(self.modalities)

    @staticmethod
    def from_dict(obj: dict[str, Any], base_dir: Path | None = None) -> ModelConfig:
        mods = _req(obj, "modalities", "")
        if not isinstance(mods, dict) or len(mods) < 2:
            raise ConfigError("modalities: need an object with at least 2 modalities")
        parsed = {}
        for name, spec in mods.items():
            if not isinstance(name, str) or not name.isidentifier() or "+" in name:
                raise ConfigError(f"modalities.{name}: a modality name must be an identifier")
            parsed[name] = ModalityConfig.from_dict(spec, f"modalities.{name}", base_dir)
        head = obj.get("head", "hclip")
        if head not in HEADS:
            raise ConfigError(f"head: unknown head {head!r} (known: {', '.join(HEADS)})")
        if head == "clip" and len(parsed) != 2:
            raise ConfigError(f"head: 'clip' needs exactly 2 modalities, got {len(parsed)}")
        latent = _int(obj.get("latent_dim", 64), "latent_dim")
        for name, m in parsed.items():
            if m.kind == "embedding" and m.map == "none" and m.dim != latent:
                raise ConfigError(
                    f"modalities.{name}.dim: an embedding without a map is used as it is, so its "
                    f'dim must equal latent_dim ({latent}), got {m.dim}; set "map": "linear" '
                    f"to learn a linear map from {m.dim} to {latent}"
                )
        return ModelConfig(modalities=parsed, head=head, latent_dim=latent)

    def to_dict(self) -> dict[str, Any]:
        return {
            "modalities": {n: self.modalities[n].to_dict() for n in self.names},
            "head": self.head,
            "latent_dim": self.latent_dim,
        }


def _every(value: Any, path: str) -> tuple[int, str]:
    """`every`: a number of epochs, or "N epochs" / "N steps"."""
    if isinstance(value, str):
        parts = value.split()
        unit = parts[1] if len(parts) == 2 else ""
        if len(parts) == 2 and parts[0].isdigit() and unit.rstrip("s") + "s" in VALIDATION_UNITS:
            return _int(int(parts[0]), path), unit.rstrip("s") + "s"
        raise ConfigError(f'{path}: expected a number of epochs, "N epochs" or "N steps"')
    return _int(value, path), "epochs"


@dataclass(frozen=True)
class ValidationConfig:
    """`train.validation`: held-out records and when to evaluate retrieval on them."""

    records: str
    every: int = 1
    unit: str = "epochs"  # or "steps"
    max_records: int = 0  # 0: every record of the file
    candidates: int = 0  # records each query is ranked against; 0: all of them

    @staticmethod
    def from_dict(obj: Any) -> ValidationConfig:
        path = "train.validation"
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}: expected an object with 'records'")
        _check_keys(obj, {"records", "every", "max_records", "candidates"}, path + ".")
        records = _req(obj, "records", path + ".")
        if not isinstance(records, str) or not records:
            raise ConfigError(f"{path}.records: expected a path string")
        every, unit = _every(obj.get("every", 1), f"{path}.every")
        return ValidationConfig(
            records=records,
            every=every,
            unit=unit,
            max_records=_int(obj.get("max_records", 0), f"{path}.max_records", minimum=0),
            candidates=_int(obj.get("candidates", 0), f"{path}.candidates", minimum=0),
        )


@dataclass(frozen=True)
class TrainConfig:
    records: str
    epochs: int = 20
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    weight_decay: float = 0.0
    loss: str = "full_conditional"  # sum_of_pairs/clip heads may also use "pairwise"
    log_every: int = 50
    num_threads: int = 0  # 0: let torch decide
    device: str = "auto"  # auto: cuda when torch sees one, else cpu
    precision: str = "auto"  # auto: bf16 autocast where the device supports it (not on cpu)
    num_workers: int = 0  # DataLoader worker processes that read and decode records
    checkpoint_every: int = 0  # steps between resumable checkpoints; 0: none
    queue_size: int = 0  # negatives kept from earlier batches (full_conditional loss); 0: none
    queue_momentum: float = 0.999  # with a queue: EMA rate of the candidates' encoders (MoCo)
    media_root: str | None = None  # where media paths may lead; None: the records file's folder
    validation: ValidationConfig | None = None  # held-out retrieval during training
    keep: str = "last"  # "best": the weights of the validation point with the best mean hit@1
    log_dir: str | None = None  # TensorBoard event files and metrics.jsonl go here

    @staticmethod
    def from_dict(obj: Any) -> TrainConfig:
        if not isinstance(obj, dict):
            raise ConfigError("train: expected an object")
        _check_keys(obj, set(TrainConfig.__dataclass_fields__), "train.")
        records = _req(obj, "records", "train.")
        if not isinstance(records, str) or not records:
            raise ConfigError("train.records: expected a path string")
        media_root = obj.get("media_root")
        if media_root is not None and (not isinstance(media_root, str) or not media_root):
            raise ConfigError("train.media_root: expected a directory path string")
        validation = obj.get("validation")
        if validation is not None:
            validation = ValidationConfig.from_dict(validation)
        keep = _choice(obj.get("keep", "last"), KEEPS, "train.keep")
        if keep == "best" and validation is None:
            raise ConfigError("train.keep: 'best' needs train.validation to choose by")
        log_dir = obj.get("log_dir")
        if log_dir is not None and (not isinstance(log_dir, str) or not log_dir):
            raise ConfigError("train.log_dir: expected a directory path string")
        loss = obj.get("loss", "full_conditional")
        if loss not in LOSSES:
            raise ConfigError(f"train.loss: unknown loss {loss!r} (known: {', '.join(LOSSES)})")
        return TrainConfig(
            records=records,
            epochs=_int(obj.get("epochs", 20), "train.epochs"),
            batch_size=_int(obj.get("batch_size", 256), "train.batch_size", minimum=2),
            lr=_float(obj.get("lr", 1e-3), "train.lr"),
            seed=_int(obj.get("seed", 0), "train.seed", minimum=0),
            weight_decay=_float(obj.get("weight_decay", 0.0), "train.weight_decay", False),
            loss=loss,
            log_every=_int(obj.get("log_every", 50), "train.log_every"),
            num_threads=_int(obj.get("num_threads", 0), "train.num_threads", minimum=0),
            device=_choice(obj.get("device", "auto"), DEVICES, "train.device"),
            precision=_choice(obj.get("precision", "auto"), PRECISIONS, "train.precision"),
            num_workers=_int(obj.get("num_workers", 0), "train.num_workers", minimum=0),
            checkpoint_every=_int(
                obj.get("checkpoint_every", 0), "train.checkpoint_every", minimum=0
            ),
            queue_size=_int(obj.get("queue_size", 0), "train.queue_size", minimum=0),
            queue_momentum=_fraction(obj.get("queue_momentum", 0.999), "train.queue_momentum"),
            media_root=media_root,
            validation=validation,
            keep=keep,
            log_dir=log_dir,
        )


@dataclass(frozen=True)
class RunConfig:
    """A whole training config file: the model plus how to train it."""

    model: ModelConfig
    train: TrainConfig
    base_dir: Path = field(default=Path("."))

    @property
    def records_path(self) -> Path:
        return (self.base_dir / self.train.records).resolve()

    @property
    def validation_path(self) -> Path | None:
        v = self.train.validation
        return None if v is None else (self.base_dir / v.records).resolve()

    @property
    def log_dir(self) -> Path | None:
        return None if self.train.log_dir is None else (self.base_dir / self.train.log_dir)

    def input_limits(self) -> InputLimits:
        """What decoding a training record may read: files inside train.media_root (resolved
        like train.records), else inside the records file's folder."""
        if self.train.media_root is None:
            return DEFAULT_LIMITS
        root = (self.base_dir / self.train.media_root).resolve()
        if not root.is_dir():
            raise ConfigError(f"train.media_root: {root} is not a directory")
        return replace(DEFAULT_LIMITS, media_root=root)

    @staticmethod
    def from_dict(obj: Any, base_dir: Path) -> RunConfig:
        if not isinstance(obj, dict):
            raise ConfigError("config: expected a JSON object at the top level")
        _check_keys(obj, {"modalities", "head", "latent_dim", "train"}, "")
        model = ModelConfig.from_dict(obj, base_dir)
        train = TrainConfig.from_dict(_req(obj, "train", ""))
        if train.loss == "pairwise" and model.head not in ("sum_of_pairs", "clip"):
            raise ConfigError(
                f"train.loss: 'pairwise' applies to sum_of_pairs and clip heads, not {model.head!r}"
            )
        if train.queue_size and train.loss != "full_conditional":
            raise ConfigError(
                f"train.queue_size: the negatives queue serves the full_conditional loss, "
                f"not {train.loss!r}"
            )
        return RunConfig(model=model, train=train, base_dir=base_dir)

    @staticmethod
    def load(path: str | Path) -> RunConfig:
        path = Path(path)
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        return RunConfig.from_dict(obj, path.parent)

    def to_dict(self) -> dict[str, Any]:
        out = self.model.to_dict()
        out["train"] = asdict(self.train)
        return out
