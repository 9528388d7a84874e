"""The errors a user's mistake in a model directory or a plugin raises, importable without
torch (the command line names them without loading a model)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model directory is missing, corrupt, pickled, or does not match its config."""


class PluginError(ValueError):
    """A plugin is not installed, fails to load, or its weights do not fit its tower."""


class PretrainedError(ValueError):
    """A `transformers` tower is not on disk, or its processor or model does not fit the
    modality's input."""
