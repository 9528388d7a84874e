"""One log format for every hclip process: the command line's and each `serve --workers` worker
(a fresh interpreter, which the command's own set-up does not reach)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
