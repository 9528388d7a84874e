"""Optional dependencies: what serving does not need is an extra (`pip install 'hclip[demo]'`),
imported only by the command that uses it, which then says how to get it if it is missing."""

from __future__ import annotations

import importlib
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


# The `onnx` extra: ONNX Runtime, and what torch's ONNX exporter needs.
ONNX_MODULES = ("onnxruntime", "onnx", "onnxscript")


def require_onnx(purpose: str) -> None:
    for module in ONNX_MODULES:
        require(module, "onnx", purpose)
