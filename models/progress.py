"""The progress bars every long command shows (training, index builds, the demo): tqdm, drawn
only once the work has gone on for a second (a command that fails at once shows none), and
with no time-to-go until enough is done to estimate it (the first steps include start-up)."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

SHOW_AFTER_S = 1.0
ESTIMATE_FROM = 0.02  # of the total done: the remaining time is shown from then on


class Progress(tqdm):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("delay", SHOW_AFTER_S)
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(super().format_dict)
        if d.get("total") and d["n"] < ESTIMATE_FROM * d["total"]:
            d["rate"] = None  # tqdm then shows '?' for the remaining time
        return d
