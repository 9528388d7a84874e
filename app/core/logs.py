"""One log format for every hclip process: the command line's and each `serve --workers` worker
(a fresh interpreter, which the command's own set-up does not reach)."""

from __future__ import annotations

import logging

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
