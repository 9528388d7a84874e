"""One log format for every hclip process: the command line's and each `serve --workers` worker
(a fresh interpreter, which the command's own set-up does not reach)."""

from __future__ import annotations

import logging
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Libraries whose INFO lines are set-up detail (faiss.loader logs each build it tried to load):
# shown with --verbose only.
CHATTY = ("faiss.loader",)


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
    for name in CHATTY:
        logging.getLogger(name).setLevel(
            level if level <= logging.DEBUG else max(level, logging.WARNING)
        )


def dict_config(level: int = logging.INFO) -> dict[str, Any]:
    """The same format as a logging.config dictionary: what uvicorn sets up in each worker
    process it starts (its `log_config`), so that a worker logs the app's lines as well."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"format": FORMAT}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default"}},
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            name: {"level": level if level <= logging.DEBUG else max(level, logging.WARNING)}
            for name in CHATTY
        },
    }
