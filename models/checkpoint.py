"""Model directories: `config.json` plus `model.safetensors`, written atomically, never pickled.

Loading checks every tensor's name and shape against the architecture that the config
describes, and refuses pickles, truncated files and non-finite weights with a message that
names the file and the tensor. A plugin modality's frozen tower is not in the directory: its
config names the weights file, and the fingerprint hashes that file too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from models.config import ConfigError, ModelConfig
from models.errors import CheckpointError, PretrainedError
from models.model import MultimodalModel
from models.plugins import PluginError, plugin_identity
from models.tensor_files import check_tensors, read_tensors, replace_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def prepare_out_dir(out: Path, overwrite: bool = False) -> None:
    """Refuse to clobber a non-empty --out unless asked, before any expensive work starts."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"--out {out}: directory is not empty (pass --overwrite to replace it)"
        )


def save_model(
    model: MultimodalModel,
    out: str | Path,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
    files: dict[str, str] | None = None,
) -> Path:
    """Write the model directory next to `out` under a temporary name, then rename it into place;
    `files` (name -> text) are written beside the config (training's validation figures and
    metrics: not part of the model, nor of its fingerprint).

    A crash at any point leaves either the old `out` or the new one, never a mixture.
    """
    out = Path(out)
    prepare_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp: Path) -> None:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "hclip"})
        config = {"format_version": FORMAT_VERSION, **model.cfg.to_dict(), **(extra or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)

    return replace_dir(out, f".{out.name}.tmp-", fill)


def read_config(model_dir: Path) -> tuple[ModelConfig, dict[str, Any]]:
    cfg_path = model_dir / CONFIG_FILE
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON (line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    try:
        # A relative plugin weights path in a model directory is relative to the directory.
        cfg = ModelConfig.from_dict(raw, base_dir=model_dir)
    except ConfigError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    return cfg, raw


def build_model(cfg: ModelConfig) -> MultimodalModel:
    """The architecture of a config; a plugin's tower that cannot be loaded is a CheckpointError."""
    try:
        return MultimodalModel(cfg)
    except PluginError as exc:
        raise CheckpointError(str(exc)) from None


def load_model(model_dir: str | Path) -> MultimodalModel:
    """Rebuild the architecture from config.json and load weights after checking every shape."""
    model_dir = Path(model_dir)
    cfg, _ = read_config(model_dir)
    weights = model_dir / WEIGHTS_FILE
    state = read_tensors(weights, CheckpointError)
    try:
        model = build_model(cfg)
    except ConfigError as exc:
        raise CheckpointError(f"{model_dir / CONFIG_FILE}: {exc}") from None
    check_tensors(weights, state, model.state_dict(), CheckpointError)
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def _hash_file(path: Path, h: Any) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def _plugin_block(cfg: ModelConfig) -> dict[str, Any]:
    """Per plugin modality: the package that decodes its inputs and the hash of its weights."""
    out: dict[str, Any] = {}
    for name in cfg.names:
        m = cfg.modalities[name]
        if m.kind != "plugin":
            continue
        assert m.plugin is not None and m.weights is not None
        h = hashlib.sha256()
        try:
            _hash_file(Path(m.weights), h)
            identity = plugin_identity(m.plugin)
        except FileNotFoundError:
            raise CheckpointError(
                f"modalities.{name}.weights: plugin {m.plugin!r} weights file not found: "
                f"{m.weights}"
            ) from None
        except PluginError as exc:
            raise CheckpointError(f"modalities.{name}.plugin: {exc}") from None
        out[name] = {**identity, "weights_sha256": h.hexdigest()}
    return out


def fingerprint(model_dir: str | Path) -> str:
    """A content hash of the config's architecture and the weights: equal iff same model.

    For a model with plugin modalities it also covers each plugin's package and version and
    the content of its weights file (not its path: a moved file is the same model), and for
    one with `transformers` towers each tower's revision and files (not its path either)."""
    model_dir = Path(model_dir)
    cfg, _ = read_config(model_dir)
    arch = cfg.to_dict()
    plugins = _plugin_block(cfg)
    for name in plugins:
        del arch["modalities"][name]["weights"]
    towers = _pretrained_block(cfg)
    for name in towers:  # a tower is its files (identity), wherever it lies
        del arch["modalities"][name]["model"]
    h = hashlib.sha256()
    h.update(json.dumps(arch, sort_keys=True).encode())
    _hash_file(model_dir / WEIGHTS_FILE, h)
    if plugins:  # absent otherwise, so that models without plugins keep their fingerprints
        h.update(json.dumps(plugins, sort_keys=True).encode())
    if towers:  # likewise: the pretrained towers' revisions and files
        h.update(json.dumps(towers, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _pretrained_block(cfg: ModelConfig) -> dict[str, Any]:
    from models.encoders.tower_files import identity

    out: dict[str, Any] = {}
    for name in cfg.names:
        m = cfg.modalities[name]
        if m.kind == "transformers":
            assert m.model is not None
            try:
                out[name] = identity(m.model)
            except PretrainedError as exc:
                raise CheckpointError(f"modalities.{name}.model: {exc}") from None
    return out
