"""Optional dependencies: what serving does not need is an extra (`pip install 'hclip[demo]'`),
imported only by the command that uses it, which then says how to get it if it is missing."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


class ExtraMissing(RuntimeError):
    """A command needs a package from one of the project's extras."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExtraMissing(
            f"{purpose} needs {module.split('.')[0]}, from the {extra!r} extra: "
            f"pip install 'hclip[{extra}]' (or, in a checkout, pip install -e '.[{extra}]')"
        ) from None


# The `onnx` extra: ONNX Runtime (load_onnxruntime), and what torch's ONNX exporter needs.
EXPORTER_MODULES = ("onnx", "onnxscript")
# ONNX Runtime 1.29 and later upload usage events to Microsoft from Linux and macOS by default,
# and keep a device id and an event store under ~/.cache: a service must not phone home from
# its users' machines. It reads this once, when it loads; a value the user set wins.
ORT_TELEMETRY_OFF = ("ORT_DISABLE_TELEMETRY", "1")


def load_onnxruntime(purpose: str) -> ModuleType:
    """onnxruntime, loaded with its telemetry off (ORT_TELEMETRY_OFF)."""
    os.environ.setdefault(*ORT_TELEMETRY_OFF)
    return require("onnxruntime", "onnx", purpose)


def require_onnx(purpose: str) -> None:
    load_onnxruntime(purpose)
    for module in EXPORTER_MODULES:
        require(module, "onnx", purpose)
