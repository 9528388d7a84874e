"""Scoring heads: H-CLIP and its baselines, all exposing the two retrieval factors of
docs/design.md §1.

For any query set Q (and target set T, its complement) every head satisfies

    Phi(tuple) = < query_factor(Q), record_factor(T) > + query_constant(Q)

The record factor depends on the record alone, so it is what the indexer stores; the query
constant is the same for every record of one query, so it never changes a ranking and the
server can drop it. The indexer and the server therefore never special-case a head.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

import torch
from torch import nn

MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(logit_scale)
INIT_LOGIT_SCALE = 1.0 / 0.07  # CLIP's initial temperature


def split_modalities(names: Sequence[str], query: Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """Validate a query set and return (Q, T) as sorted tuples."""
    q = tuple(sorted(set(query)))
    unknown = [n for n in q if n not in names]
    if unknown:
        raise ValueError(f"unknown modality {unknown[0]!r} (known: {', '.join(names)})")
    if not q:
        raise ValueError("a query needs at least one modality")
    t = tuple(n for n in sorted(names) if n not in q)
    if not t:
        raise ValueError("a query cannot name every modality: nothing would be left to retrieve")
    return q, t


def view_name(query: Iterable[str]) -> str:
    return "+".join(sorted(query))


def default_views(names: Sequence[str]) -> list[tuple[str, ...]]:
    """docs/design.md §4: every single modality, and for m >= 3 every all-but-one set."""
    names = sorted(names)
    views: list[tuple[str, ...]] = [(n,) for n in names]
    if len(names) >= 3:
        views += [tuple(n for n in names if n != left) for left in names]
    return views


def _hadamard(embs: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    out = embs[names[0]]
    for n in names[1:]:
        out = out * embs[n]
    return out  # (B, d)


class Head(nn.Module, ABC):
    """Common state: the modality names and CLIP's learned, clamped logit scale."""

    kind = "base"

    def __init__(self, names: Sequence[str], latent_dim: int):
        super().__init__()
        self.names = sorted(names)
        self.latent_dim = latent_dim
        self.logit_scale = nn.Parameter(torch.tensor(math.log(INIT_LOGIT_SCALE)))

    @property
    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=math.log(MAX_LOGIT_SCALE)).exp()

    @torch.no_grad()
    def clamp_(self) -> None:
        """Called after each optimiser step, as CLIP does, so the scale never passes 100."""
        self.logit_scale.clamp_(0.0, math.log(MAX_LOGIT_SCALE))

    @property
    def factor_dim(self) -> int:
        return self.latent_dim

    def score(self, embs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Phi of aligned tuples: embs[name] is (B, d) for every modality; returns (B,)."""
        q, t = split_modalities(self.names, self.names[:1])
        qf = self.query_factor(embs, q)
        rf = self.record_factor(embs, t)
        return (qf * rf).sum(-1) + self.query_constant(embs, q)

    @abstractmethod
    def query_factor(self, embs: Mapping[str, torch.Tensor], query: Sequence[str]) -> torch.Tensor:
        """(B, factor_dim): the per-request side; embs holds at least the query modalities."""

    @abstractmethod
    def record_factor(
        self, embs: Mapping[str, torch.Tensor], target: Sequence[str]
    ) -> torch.Tensor:
        """(B, factor_dim): the per-record side that the indexer stores."""

    def query_constant(
        self, embs: Mapping[str, torch.Tensor], query: Sequence[str]
    ) -> torch.Tensor:
        first = embs[query[0]]
        return torch.zeros(first.shape[0], dtype=first.dtype, device=first.device)

    def public_params(self) -> dict[str, object]:
        """What a client needs to recompute a score from stored embeddings (GET /v1/info)."""
        return {"logit_scale": float(self.scale.detach())}


class HClipHead(Head):
    """Phi = omega . (g_1 * ... * g_m), omega = scale * w with w learned per dimension."""

    kind = "hclip"

    def __init__(self, names: Sequence[str], latent_dim: int):
        super().__init__(names, latent_dim)
        # The product of m unit vectors sums to about d^((1-m)/2) where CLIP's inner product
        # (m = 2) gives d^(-1/2); starting omega at d^((m-2)/2) gives the first logits CLIP's
        # spread. With all ones, a three-way model sits on a plateau of near-uniform softmax.
        init = float(latent_dim) ** ((len(self.names) - 2) / 2.0)
        self.weight = nn.Parameter(torch.full((latent_dim,), init))

    @property
    def omega(self) -> torch.Tensor:
        return self.scale * self.weight  # (d,)

    def query_factor(self, embs: Mapping[str, torch.Tensor], query: Sequence[str]) -> torch.Tensor:
        return self.omega * _hadamard(embs, query)  # (B, d)

    def record_factor(
        self, embs: Mapping[str, torch.Tensor], target: Sequence[str]
    ) -> torch.Tensor:
        return _hadamard(embs, target)  # (B, d)

    def public_params(self) -> dict[str, object]:
        return {"omega": self.omega.detach().tolist()}


class SymileHead(HClipHead):
    """Symile: H-CLIP with omega fixed to a (learned) scalar times the all-ones vector."""

    kind = "symile"

    def __init__(self, names: Sequence[str], latent_dim: int):
        super().__init__(names, latent_dim)
        self.weight.requires_grad_(False)


class SumOfPairsHead(Head):
    """Phi = scale * sum_{i<j} <g_i, g_j>: the usual pairwise extension of CLIP.

    As one MIPS: query [sum_Q g ; 1] * scale, record [sum_T g ; c_T] with c_T the pairwise
    term inside T; the pairwise term inside Q is the query constant.
    """

    kind = "sum_of_pairs"

    @property
    def factor_dim(self) -> int:
        return self.latent_dim + 1

    @staticmethod
    def _pairs_inside(embs: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
        first = embs[names[0]]
        total = torch.zeros(first.shape[0], dtype=first.dtype, device=first.device)
        for a, b in combinations(names, 2):
            total = total + (embs[a] * embs[b]).sum(-1)
        return total  # (B,)

    def query_factor(self, embs: Mapping[str, torch.Tensor], query: Sequence[str]) -> torch.Tensor:
        summed = torch.stack([embs[n] for n in query]).sum(0)  # (B, d)
        ones = torch.ones(summed.shape[0], 1, dtype=summed.dtype, device=summed.device)
        return self.scale * torch.cat([summed, ones], dim=-1)  # (B, d + 1)

    def record_factor(
        self, embs: Mapping[str, torch.Tensor], target: Sequence[str]
    ) -> torch.Tensor:
        summed = torch.stack([embs[n] for n in target]).sum(0)  # (B, d)
        inside = self._pairs_inside(embs, target)[:, None]
        return torch.cat([summed, inside], dim=-1)  # (B, d + 1)

    def query_constant(
        self, embs: Mapping[str, torch.Tensor], query: Sequence[str]
    ) -> torch.Tensor:
        return self.scale * self._pairs_inside(embs, query)


class ClipHead(SumOfPairsHead):
    """Two-tower CLIP (m = 2): the sum of pairs has a single pair."""

    kind = "clip"


HEADS: dict[str, type[Head]] = {
    h.kind: h for h in (HClipHead, SymileHead, SumOfPairsHead, ClipHead)
}


def build_head(kind: str, names: Sequence[str], latent_dim: int) -> Head:
    return HEADS[kind](names, latent_dim)
