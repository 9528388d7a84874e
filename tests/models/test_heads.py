"""The two retrieval factors reproduce the full score Phi, for every head and query set."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch

from models.heads import build_head, split_modalities

NAMES3 = ["audio", "image", "text"]


def unit(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.normalize(
        torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1
    )


def naive_phi(kind: str, head, embs: dict[str, torch.Tensor]) -> torch.Tensor:
    """docs/design.md §1 written out term by term."""
    names = sorted(embs)
    n = embs[names[0]].shape[0]
    out = torch.zeros(n, dtype=torch.float64)
    for row in range(n):
        if kind in ("hclip", "symile"):
            prod = torch.ones_like(embs[names[0]][row])
            for m in names:
                prod = prod * embs[m][row]
            out[row] = (head.omega.double() * prod).sum()
        else:
            out[row] = sum(float(embs[a][row] @ embs[b][row]) for a, b in combinations(names, 2))
            out[row] *= float(head.scale.detach())
    return out


def query_sets(names: list[str]) -> list[tuple[str, ...]]:
    return [q for r in range(1, len(names)) for q in combinations(names, r)]


@pytest.mark.parametrize("kind", ["hclip", "symile", "sum_of_pairs", "clip"])
def test_factors_reproduce_phi_for_every_query_set(kind: str) -> None:
    names = (
        ["image", "text"] if kind == "clip" else NAMES3 + (["sensor"] if kind != "symile" else [])
    )
    gen = torch.Generator().manual_seed(1)
    head = build_head(kind, names, 16).double()
    with torch.no_grad():
        head.logit_scale.fill_(1.7)
        if kind == "hclip":
            head.weight.copy_(torch.randn(16, generator=gen))
    embs = {m: unit(7, 16, gen) for m in names}
    phi = naive_phi(kind, head, embs)
    torch.testing.assert_close(head.score(embs), phi)
    for q in query_sets(sorted(names)):
        q_, t = split_modalities(head.names, q)
        qf = head.query_factor({m: embs[m] for m in q_}, q_)  # only the query's modalities
        rf = head.record_factor({m: embs[m] for m in t}, t)  # only the record's
        assert qf.shape == rf.shape == (7, head.factor_dim)
        got = (qf * rf).sum(-1) + head.query_constant(embs, q_)
        torch.testing.assert_close(got, phi, msg=f"{kind} query {q}")


def test_query_constant_never_changes_a_ranking() -> None:
    gen = torch.Generator().manual_seed(2)
    head = build_head("sum_of_pairs", NAMES3, 8).double()
    query = {m: unit(1, 8, gen) for m in ("audio", "image")}
    records = unit(20, 8, gen)
    qf = head.query_factor(query, ("audio", "image"))
    ranking = torch.argsort(
        qf @ head.record_factor({"text": records}, ("text",)).T, descending=True
    )
    full = torch.stack(
        [
            head.score(
                {"audio": query["audio"], "image": query["image"], "text": records[i : i + 1]}
            )
            for i in range(20)
        ]
    )[:, 0]
    assert torch.equal(ranking[0], torch.argsort(full, descending=True))


def test_symile_omega_is_scalar_times_ones() -> None:
    head = build_head("symile", NAMES3, 8)
    assert not head.weight.requires_grad
    assert torch.allclose(head.omega, head.omega[0].expand(8))


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ((), "at least one"),
        (tuple(NAMES3), "every modality"),
        (("smell",), "unknown modality 'smell'"),
    ],
)
def test_bad_query_sets_are_named(query: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_modalities(NAMES3, query)


def test_logit_scale_is_clamped_at_100() -> None:
    head = build_head("hclip", NAMES3, 4)
    with torch.no_grad():
        head.logit_scale.fill_(10.0)
    assert float(head.scale.detach()) == pytest.approx(100.0)
    head.clamp_()
    assert float(head.logit_scale.detach().exp()) == pytest.approx(100.0)
