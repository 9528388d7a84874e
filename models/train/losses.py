"""Contrastive losses, with logits and targets as separate, testable pieces.

`keys[name]` holds one integer per batch row identifying its raw input (equal inputs, equal
keys). Rows whose inputs coincide with the positive's are masked out of the softmax, so that a
true pair is never counted as a negative; with few distinct inputs (a symbol set of 8) most of
a batch would otherwise be false negatives.

With a negatives queue (models.train.queue) the queued entries join the candidates and are masked by
the same rule through the keys they keep. As in MoCo, the candidates' side then comes from the
momentum encoders (`targets`: the batch's embeddings by an EMA copy of the encoders, and the
queue holds earlier such embeddings) and gradients flow through the query side only. Were the
candidates the online encoders' embeddings, batch rows (encoded now) and queued ones (encoded
steps ago) would differ by the encoders' drift, and drifting alone would tell the positive apart:
training then stalls at a uniform softmax, as MoCo reports for a momentum of 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import torch
from torch import nn

from models.heads import Head, split_modalities
from models.train.queue import NegativesQueue


@dataclass
class LossOutput:
    loss: torch.Tensor
    batch_size: int
    candidates: int = 0  # per softmax: the batch plus the queued entries; 0: the batch alone

    @property
    def ceiling_bits(self) -> float:
        """log2 of the candidates each softmax chooses from: log2(batch + queue)."""
        return math.log2(self.candidates or self.batch_size)

    @property
    def mi_bound_bits(self) -> float:
        """InfoNCE lower bound on mutual information, log2(N) - L / ln 2 (never above log2 N)."""
        return self.ceiling_bits - float(self.loss.detach()) / math.log(2.0)


def full_conditional_logits(
    head: Head, embs: Mapping[str, torch.Tensor], target: str
) -> torch.Tensor:
    """(N, N): entry [n, n'] is Phi(all modalities but `target` from row n, `target` from n')."""
    query = [n for n in head.names if n != target]
    q, t = split_modalities(head.names, query)
    qf = head.query_factor(embs, q)  # (N, D)
    rf = head.record_factor(embs, t)  # (N, D)
    return qf @ rf.T + head.query_constant(embs, q)[:, None]


def queued_logits(
    head: Head,
    embs: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    queued: Mapping[str, torch.Tensor],
    query: list[str],
) -> torch.Tensor:
    """(N, N + K): batch row n's query modalities (from `embs`) against the target side of every
    batch row (from `targets`), then of every queued entry."""
    q, t = split_modalities(head.names, query)
    qf = head.query_factor(embs, q)  # (N, D)
    rf = torch.cat([head.record_factor(targets, t), head.record_factor(queued, t)])  # (N + K, D)
    return qf @ rf.T + head.query_constant(embs, q)[:, None]


def duplicate_mask(keys: torch.Tensor) -> torch.Tensor:
    """(N, N) True where rows n != n' hold equal inputs; keys is (N,) or (N, k)."""
    if keys.dim() == 1:
        keys = keys[:, None]
    same = (keys[:, None, :] == keys[None, :, :]).all(-1)  # (N, N)
    return same & ~torch.eye(keys.shape[0], dtype=torch.bool, device=keys.device)


def queue_duplicate_mask(keys: torch.Tensor, queued: torch.Tensor) -> torch.Tensor:
    """(N, K) True where queued entry j holds batch row n's inputs; (N,)/(K,) or (N, k)/(K, k)."""
    if keys.dim() == 1:
        keys, queued = keys[:, None], queued[:, None]
    return (keys[:, None, :] == queued[None, :, :]).all(-1)  # (N, K)


def masked_cross_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row-wise cross-entropy with the diagonal as target and masked entries removed."""
    logits = logits.masked_fill(mask, float("-inf"))
    targets = torch.arange(logits.shape[0], device=logits.device)
    return nn.functional.cross_entropy(logits, targets)


class FullConditionalLoss(nn.Module):
    """Every modality against the joint of the others, in both directions (H-CLIP, Symile)."""

    def forward(
        self,
        head: Head,
        embs: Mapping[str, torch.Tensor],
        keys: Mapping[str, torch.Tensor],
        queue: NegativesQueue | None = None,
        targets: Mapping[str, torch.Tensor] | None = None,
    ) -> LossOutput:
        """`targets`: the candidates' side of the batch (momentum encoders), with a queue."""
        if queue is not None:
            qe, qk = queue.entries()
            return self._with_queue(head, embs, keys, embs if targets is None else targets, qe, qk)
        n = next(iter(embs.values())).shape[0]
        terms = []
        for target in head.names:
            logits = full_conditional_logits(head, embs, target)  # (N, N)
            others = torch.stack([keys[o] for o in head.names if o != target], dim=-1)
            # rows: given the others, pick the target; columns: given the target, pick the others
            terms.append(masked_cross_entropy(logits, duplicate_mask(keys[target])))
            terms.append(masked_cross_entropy(logits.T, duplicate_mask(others)))
        return LossOutput(torch.stack(terms).mean(), n)

    @staticmethod
    def _with_queue(
        head: Head,
        embs: Mapping[str, torch.Tensor],
        keys: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        qe: Mapping[str, torch.Tensor],
        qk: Mapping[str, torch.Tensor],
    ) -> LossOutput:
        """As above, each softmax also over the queue: a queued entry is a further candidate
        target in one direction and a further candidate joint of the others in the other."""
        n = next(iter(embs.values())).shape[0]
        k = next(iter(qk.values())).shape[0]
        terms = []
        for target in head.names:
            others = [o for o in head.names if o != target]
            ko = torch.stack([keys[o] for o in others], dim=-1)  # (N, m - 1)
            qko = torch.stack([qk[o] for o in others], dim=-1)  # (K, m - 1)
            # given the others, pick the target among N + K
            logits = queued_logits(head, embs, targets, qe, others)  # (N, N + K)
            mask = torch.cat(
                [duplicate_mask(keys[target]), queue_duplicate_mask(keys[target], qk[target])], 1
            )
            terms.append(masked_cross_entropy(logits, mask))
            # given the target, pick the others among N + K
            logits = queued_logits(head, embs, targets, qe, [target])  # (N, N + K)
            mask = torch.cat([duplicate_mask(ko), queue_duplicate_mask(ko, qko)], 1)
            terms.append(masked_cross_entropy(logits, mask))
        return LossOutput(torch.stack(terms).mean(), n, candidates=n + k)


class PairwiseClipLoss(nn.Module):
    """The sum of two-tower CLIP losses over every pair of modalities (sum-of-pairs baseline)."""

    def forward(
        self,
        head: Head,
        embs: Mapping[str, torch.Tensor],
        keys: Mapping[str, torch.Tensor],
        queue: NegativesQueue | None = None,
        targets: Mapping[str, torch.Tensor] | None = None,
    ) -> LossOutput:
        if queue is not None or targets is not None:
            raise ValueError("the negatives queue serves the full_conditional loss only")
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
