"""Encoder towers from installed packages, found through the entry-point group `hclip.encoders`.

A package offers a tower by naming a TowerPlugin subclass among its entry points:

    [project.entry-points."hclip.encoders"]
    my_tower = "my_package.hclip:MyTower"

and a config uses it as `{"kind": "plugin", "plugin": "my_tower", "weights": "tower.safetensors",
"options": {...}}`. The plugin decodes raw inputs and builds the tower's architecture; hclip loads
the weights from the safetensors file (never a pickle), checking every tensor's name and shape.
The tower stays frozen, like MiniLM for `text`: it runs where inputs are prepared (DataLoader
workers in training, encode threads in the service) and only the layers above it train. Its
weights live outside the model directory, so checkpoint.fingerprint hashes them as well.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import replace
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.config import ConfigError, ModalityConfig, ModelConfig
from models.errors import PluginError
from models.limits import InputLimits
from models.tensor_files import check_tensors, read_tensors

ENTRY_POINT_GROUP = "hclip.encoders"


class TowerPlugin(ABC):
    """What an `hclip.encoders` entry point names (a subclass, built with no arguments)."""

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Validate and complete a config's `options`. Raise models.config.ConfigError with a
        message that starts with the option's name ("size: must be >= 8"); hclip prefixes the
        JSON path of `options`. The result is stored in the model's config.json."""
        return options

    @abstractmethod
    def feature_dim(self, options: Mapping[str, Any]) -> int:
        """Width of the tower's output, (B, feature_dim)."""

    @abstractmethod
    def decode(
        self, value: Any, options: Mapping[str, Any], base_dir: Path | None, limits: InputLimits
    ) -> Any:
        """One raw input (a record's or a query's value) -> one item for `collate`; raise
        models.inputs.InputError on a bad value. `base_dir` is None for a query in the service:
        read media with models.inputs.read_media, which then refuses file paths."""

    def collate(self, items: list[Any]) -> torch.Tensor:
        """Decoded items -> the tower's input batch."""
        return torch.stack(items)

    @abstractmethod
    def build_tower(self, options: Mapping[str, Any]) -> nn.Module:
        """The architecture, mapping a collated batch to (B, feature_dim); hclip loads its
        weights from the config's `weights` file, so they need not be initialised here."""


def installed() -> dict[str, EntryPoint]:
    # Not cached: a package installed (or a path added) while the process runs is found.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


_plugins: dict[str, TowerPlugin] = {}


def _entry_point(name: str) -> EntryPoint:
    found = installed()
    if name not in found:
        names = ", ".join(sorted(found)) or "none"
        raise PluginError(
            f"no encoder plugin {name!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}; "
            f"installed: {names})"
        )
    return found[name]


_latest: dict[str, TowerPlugin] = {}  # by name: the hot path of decoding


def find_plugin(name: str) -> TowerPlugin:
    """Look the plugin up among the installed entry points (a scan of sys.path: milliseconds).
    Configs are checked through this, so an uninstalled plugin is noticed."""
    ep = _entry_point(name)
    key = f"{name}={ep.value}"
    if key not in _plugins:
        try:
            obj = ep.load()
        except Exception as exc:  # an import error in someone else's package
            raise PluginError(
                f"encoder plugin {name!r} ({ep.value}) failed to load: {exc!r}"
            ) from None
        plugin = obj() if isinstance(obj, type) else obj
        if not isinstance(plugin, TowerPlugin):
            raise PluginError(
                f"encoder plugin {name!r} ({ep.value}) is not a models.plugins.TowerPlugin"
            )
        _plugins[key] = plugin
    _latest[name] = _plugins[key]
    return _plugins[key]


def plugin(name: str) -> TowerPlugin:
    """The plugin a config already named, without a new scan: decoding calls this per value."""
    found = _latest.get(name)
    return found if found is not None else find_plugin(name)


def plugin_identity(name: str) -> dict[str, str]:
    """The installed package behind a plugin: its code decodes inputs, so it is part of the
    model as much as the weights are (checkpoint.fingerprint hashes this)."""
    ep = _entry_point(name)
    dist = ep.dist
    return {
        "plugin": name,
        "entry_point": ep.value,
        "distribution": dist.name if dist is not None else "",
        "version": dist.version if dist is not None else "",
    }


_towers: dict[tuple[Any, ...], nn.Module] = {}
_towers_lock = threading.Lock()


def _build_tower(cfg: ModalityConfig, path: Path) -> nn.Module:
    assert cfg.plugin is not None
    tower = plugin(cfg.plugin).build_tower(cfg.options)
    state = read_tensors(path, PluginError)
    check_tensors(path, state, tower.state_dict(), PluginError, f"plugin {cfg.plugin!r} tower")
    tower.load_state_dict(state, strict=True)
    tower.eval()
    tower.requires_grad_(False)
    return tower


def load_tower(cfg: ModalityConfig) -> nn.Module:
    """The frozen tower of a plugin modality, one per process and weights file version."""
    if cfg.plugin is None or cfg.weights is None:
        raise PluginError("a plugin modality needs 'plugin' and 'weights'")
    path = Path(cfg.weights)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise PluginError(f"plugin {cfg.plugin!r} weights file not found: {path}") from None
    # The file's identity is in the key: a replaced file is loaded afresh, never served stale.
    options = json.dumps(cfg.options, sort_keys=True)
    key = (cfg.plugin, str(path), st.st_mtime_ns, st.st_size, options)
    with _towers_lock:
        if key not in _towers:
            _towers[key] = _build_tower(cfg, path)
        return _towers[key]


def resolve_options(cfg: ModelConfig) -> ModelConfig:
    """The config with every plugin modality's plugin found and its options checked and
    completed by the plugin (what the model is built from and its config.json stores). Errors
    name the field by its JSON path (`modalities.img.options.size: ...`)."""
    resolved = dict(cfg.modalities)
    for name in cfg.names:
        m = cfg.modalities[name]
        if m.kind != "plugin":
            continue
        path = f"modalities.{name}"
        assert m.plugin is not None
        try:
            found = find_plugin(m.plugin)
        except PluginError as exc:
            raise ConfigError(f"{path}.plugin: {exc}") from None
        try:
            options = found.check_options(dict(m.options))
        except ConfigError as exc:  # the plugin names the option; we name where it sits
            raise ConfigError(f"{path}.options.{exc}") from None
        except Exception as exc:  # a plugin's own bug still gets a message naming the field
            raise ConfigError(
                f"{path}.options: plugin {m.plugin!r} refused them ({exc!r})"
            ) from None
        resolved[name] = replace(m, options=options)
    return replace(cfg, modalities=resolved)
