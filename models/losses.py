"""Contrastive losses, with logits and targets as separate, testable pieces.

`keys[name]` holds one integer per batch row identifying its raw input (equal inputs, equal
keys). Rows whose inputs coincide with the positive's are masked out of the softmax, so that a
true pair is never counted as a negative; with few distinct inputs (a symbol set of 8) most of
a batch would otherwise be false negatives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import torch
from torch import nn

from models.heads import Head, split_modalities


@dataclass
class LossOutput:
    loss: torch.Tensor
    batch_size: int

    @property
    def mi_bound_bits(self) -> float:
        """InfoNCE lower bound on mutual information, log2(N) - L / ln 2 (never above log2 N)."""
        return math.log2(self.batch_size) - float(self.loss.detach()) / math.log(2.0)

    @property
    def ceiling_bits(self) -> float:
        return math.log2(self.batch_size)


def full_conditional_logits(
    head: Head, embs: Mapping[str, torch.Tensor], target: str
) -> torch.Tensor:
    """(N, N): entry [n, n'] is Phi(all modalities but `target` from row n, `target` from n')."""
    query = [n for n in head.names if n != target]
    q, t = split_modalities(head.names, query)
    qf = head.query_factor(embs, q)  # (N, D)
    rf = head.record_factor(embs, t)  # (N, D)
    return qf @ rf.T + head.query_constant(embs, q)[:, None]


def duplicate_mask(keys: torch.Tensor) -> torch.Tensor:
    """(N, N) True where rows n != n' hold equal inputs; keys is (N,) or (N, k)."""
    if keys.dim() == 1:
        keys = keys[:, None]
    same = (keys[:, None, :] == keys[None, :, :]).all(-1)  # (N, N)
    return same & ~torch.eye(keys.shape[0], dtype=torch.bool)


def masked_cross_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row-wise cross-entropy with the diagonal as target and masked entries removed."""
    logits = logits.masked_fill(mask, float("-inf"))
    targets = torch.arange(logits.shape[0])
    return nn.functional.cross_entropy(logits, targets)


class FullConditionalLoss(nn.Module):
    """Every modality against the joint of the others, in both directions (H-CLIP, Symile)."""

    def forward(
        self, head: Head, embs: Mapping[str, torch.Tensor], keys: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        n = next(iter(embs.values())).shape[0]
        terms = []
        for target in head.names:
            logits = full_conditional_logits(head, embs, target)  # (N, N)
            others = torch.stack([keys[o] for o in head.names if o != target], dim=-1)
            # rows: given the others, pick the target; columns: given the target, pick the others
            terms.append(masked_cross_entropy(logits, duplicate_mask(keys[target])))
            terms.append(masked_cross_entropy(logits.T, duplicate_mask(others)))
        return LossOutput(torch.stack(terms).mean(), n)


class PairwiseClipLoss(nn.Module):
    """The sum of two-tower CLIP losses over every pair of modalities (sum-of-pairs baseline)."""

    def forward(
        self, head: Head, embs: Mapping[str, torch.Tensor], keys: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        n = next(iter(embs.values())).shape[0]
        terms = []
        for a, b in combinations(head.names, 2):
            logits = head.scale * embs[a] @ embs[b].T  # (N, N)
            terms.append(masked_cross_entropy(logits, duplicate_mask(keys[b])))
            terms.append(masked_cross_entropy(logits.T, duplicate_mask(keys[a])))
        # The mean over pairs, so that the bound stays comparable with the other losses.
        return LossOutput(torch.stack(terms).mean(), n)


def build_loss(name: str) -> nn.Module:
    if name == "full_conditional":
        return FullConditionalLoss()
    if name == "pairwise":
        return PairwiseClipLoss()
    raise ValueError(f"unknown loss {name!r}")
