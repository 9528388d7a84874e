"""Audio clips of unequal lengths grouped by length, and the rows computed per group put back in
the batch's order."""

from __future__ import annotations

from typing import Any

import torch


def by_length(items: list[Any]) -> list[tuple[torch.Tensor, list[Any]]]:
    """The clips of each length with their positions in the batch, lengths in the order first
    seen: clips of one length run through a tower together, unpadded (Tower.__call__ says why)."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(items):
        groups.setdefault(len(x), []).append(i)
    return [(torch.tensor(where), [items[i] for i in where]) for where in groups.values()]


def in_batch_order(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Rows computed group by group ((positions, rows) each), back in the batch's order."""
    where = torch.cat([w for w, _ in parts])
    rows = torch.cat([r for _, r in parts])
    return rows[torch.argsort(where.to(rows.device))]


# A fine-tuned audio tower's batch: per clip length, the clips' positions and their inputs.
AudioGroups = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
