"""Losses against naive loop references; duplicate masking; the MI bound's ceiling."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch

from models.heads import build_head
from models.train.losses import FullConditionalLoss, PairwiseClipLoss

NAMES = ["a", "b", "c"]


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(
        torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1
    )


def phi(head, tup: dict[str, torch.Tensor]) -> float:
    return head.score({m: v[None] for m, v in tup.items()})[0].item()


def naive_ce(scores: list[float], positive: int, excluded: set[int]) -> float:
    kept = [s for j, s in enumerate(scores) if j == positive or j not in excluded]
    return -scores[positive] + math.log(sum(math.exp(s) for s in kept))


def naive_full_conditional(head, embs, keys) -> float:
    n = embs["a"].shape[0]
    terms = []
    for target in head.names:
        others = [m for m in head.names if m != target]

        def tup(anchor_row: int, target_row: int, others=others, target=target):
            return {**{m: embs[m][anchor_row] for m in others}, target: embs[target][target_row]}

        rows, cols = [], []
        for i in range(n):
            dup_t = {j for j in range(n) if j != i and keys[target][j] == keys[target][i]}
            dup_o = {
                j for j in range(n) if j != i and all(keys[m][j] == keys[m][i] for m in others)
            }
            rows.append(naive_ce([phi(head, tup(i, j)) for j in range(n)], i, dup_t))
            cols.append(naive_ce([phi(head, tup(j, i)) for j in range(n)], i, dup_o))
        terms += [sum(rows) / n, sum(cols) / n]
    return sum(terms) / len(terms)


def naive_pairwise(head, embs, keys) -> float:
    n = embs["a"].shape[0]
    terms = []
    for a, b in combinations(head.names, 2):
        s = [
            [head.scale.item() * (embs[a][i] @ embs[b][j]).item() for j in range(n)]
            for i in range(n)
        ]
        dup = lambda m, i: {j for j in range(n) if j != i and keys[m][j] == keys[m][i]}  # noqa: E731
        terms.append(sum(naive_ce(s[i], i, dup(b, i)) for i in range(n)) / n)
        terms.append(sum(naive_ce([s[j][i] for j in range(n)], i, dup(a, i)) for i in range(n)) / n)
    return sum(terms) / len(terms)


def batch(n: int = 6, d: int = 5, with_duplicates: bool = True):
    embs = {m: unit(n, d, seed) for seed, m in enumerate(NAMES)}
    keys = {m: torch.arange(n) for m in NAMES}
    if with_duplicates:
        # row 3 repeats row 1's input in modality b, and row 5 repeats row 0's (a, b) pair
        embs["b"][3] = embs["b"][1]
        keys["b"][3] = keys["b"][1]
        for m in ("a", "b"):
            embs[m][5] = embs[m][0]
            keys[m][5] = keys[m][0]
    return embs, keys


@pytest.mark.parametrize("kind", ["hclip", "symile", "sum_of_pairs"])
@pytest.mark.parametrize("dups", [False, True])
def test_full_conditional_matches_naive(kind: str, dups: bool) -> None:
    head = build_head(kind, NAMES, 5).double()
    with torch.no_grad():
        head.logit_scale.fill_(1.3)
    embs, keys = batch(with_duplicates=dups)
    got = FullConditionalLoss()(head, embs, keys).loss
    assert got.item() == pytest.approx(naive_full_conditional(head, embs, keys), rel=1e-9)


@pytest.mark.parametrize("dups", [False, True])
def test_pairwise_matches_naive(dups: bool) -> None:
    head = build_head("sum_of_pairs", NAMES, 5).double()
    embs, keys = batch(with_duplicates=dups)
    got = PairwiseClipLoss()(head, embs, keys).loss
    assert got.item() == pytest.approx(naive_pairwise(head, embs, keys), rel=1e-9)


def test_masking_changes_the_loss_only_when_inputs_repeat() -> None:
    head = build_head("hclip", NAMES, 5).double()
    embs, keys = batch(with_duplicates=True)
    masked = FullConditionalLoss()(head, embs, keys).loss.item()
    unmasked_keys = {m: torch.arange(6) for m in NAMES}
    unmasked = FullConditionalLoss()(head, embs, unmasked_keys).loss.item()
    assert masked < unmasked  # duplicates of the positive no longer count against it


@pytest.mark.parametrize("scale", [0.0, 2.0, math.log(100.0)])
def test_mi_bound_never_exceeds_log2_n(scale: float) -> None:
    head = build_head("hclip", NAMES, 16).double()
    with torch.no_grad():
        head.logit_scale.fill_(scale)
        head.weight.fill_(50.0)  # a huge omega: near-perfect, confident predictions
    e = unit(8, 16, 0)
    embs = {m: e for m in NAMES}  # every tuple perfectly aligned
    out = FullConditionalLoss()(head, embs, {m: torch.arange(8) for m in NAMES})
    assert out.ceiling_bits == 3.0
    assert out.mi_bound_bits <= out.ceiling_bits + 1e-12
