"""The negatives queue: its loss against a plainly written reference, its ring, its ceiling."""

from __future__ import annotations

import math

import pytest
import torch

from models.heads import build_head
from models.train.losses import FullConditionalLoss
from models.train.queue import NegativesQueue
from tests.models.test_losses import NAMES, naive_ce, phi, unit


def naive_queue_loss(head, embs, targets, keys, q_embs, q_keys) -> float:
    """Every softmax over the N batch rows and then the K queued entries, each candidate's
    score Phi written out on its tuple: the asking side from `embs`, the candidates' side from
    `targets` (batch rows) or the queue; repeats of the positive's inputs left out."""
    n = embs["a"].shape[0]
    k = q_embs["a"].shape[0]

    def emb(m: str, j: int) -> torch.Tensor:
        return targets[m][j] if j < n else q_embs[m][j - n]

    def key(m: str, j: int) -> int:
        return int(keys[m][j]) if j < n else int(q_keys[m][j - n])

    terms = []
    for target in head.names:
        others = [m for m in head.names if m != target]
        rows, cols = [], []
        for i in range(n):
            # given row i's other modalities, which candidate holds its target?
            scores = [
                phi(head, {**{m: embs[m][i] for m in others}, target: emb(target, j)})
                for j in range(n + k)
            ]
            same = {j for j in range(n + k) if j != i and key(target, j) == key(target, i)}
            rows.append(naive_ce(scores, i, same))
            # given row i's target, which candidate holds its other modalities?
            scores = [
                phi(head, {**{m: emb(m, j) for m in others}, target: embs[target][i]})
                for j in range(n + k)
            ]
            same = {
                j for j in range(n + k) if j != i and all(key(m, j) == key(m, i) for m in others)
            }
            cols.append(naive_ce(scores, i, same))
        terms += [sum(rows) / n, sum(cols) / n]
    return sum(terms) / len(terms)


def batch_and_queue(n: int = 5, k: int = 7, d: int = 5):
    embs = {m: unit(n, d, seed) for seed, m in enumerate(NAMES)}
    keys = {m: torch.arange(n) for m in NAMES}
    q_embs = {m: unit(k, d, 10 + seed) for seed, m in enumerate(NAMES)}
    q_keys = {m: 100 + torch.arange(k) for m in NAMES}
    # queued entry 2 repeats batch row 1's input in c; entry 4 repeats row 3's (a, b) pair;
    # entry 6 is batch row 0 itself, queued by an earlier step (its whole tuple)
    q_embs["c"][2], q_keys["c"][2] = embs["c"][1], keys["c"][1]
    for m in ("a", "b"):
        q_embs[m][4], q_keys[m][4] = embs[m][3], keys[m][3]
    for m in NAMES:
        q_embs[m][6], q_keys[m][6] = embs[m][0], keys[m][0]
    return embs, keys, q_embs, q_keys


def filled_queue(q_embs, q_keys, size: int) -> NegativesQueue:
    queue = NegativesQueue(size, NAMES, q_embs["a"].shape[1])
    queue.embs = {m: e.double() for m, e in queue.embs.items()}
    queue.push(q_embs, q_keys)
    return queue


@pytest.mark.parametrize("kind", ["hclip", "symile", "sum_of_pairs"])
@pytest.mark.parametrize("momentum_targets", [False, True])
def test_queue_loss_matches_naive(kind: str, momentum_targets: bool) -> None:
    head = build_head(kind, NAMES, 5).double()
    with torch.no_grad():
        head.logit_scale.fill_(1.3)
        if kind == "hclip":
            head.weight.copy_(torch.linspace(0.5, 2.0, 5))
    embs, keys, q_embs, q_keys = batch_and_queue()
    # the momentum encoders' view of the same batch: close to the online one, not equal
    targets = {m: unit(5, 5, 20 + s) * 0.2 + e for s, (m, e) in enumerate(embs.items())}
    targets = {m: torch.nn.functional.normalize(t, dim=-1) for m, t in targets.items()}
    queue = filled_queue(q_embs, q_keys, 7)
    if momentum_targets:
        out = FullConditionalLoss()(head, embs, keys, queue=queue, targets=targets)
        want = naive_queue_loss(head, embs, targets, keys, q_embs, q_keys)
    else:
        out = FullConditionalLoss()(head, embs, keys, queue=queue)
        want = naive_queue_loss(head, embs, embs, keys, q_embs, q_keys)
    assert out.loss.item() == pytest.approx(want, rel=1e-9)
    assert out.candidates == 12 and out.ceiling_bits == pytest.approx(math.log2(12))


def test_queued_repeats_of_the_positive_are_masked() -> None:
    head = build_head("hclip", NAMES, 5).double()
    embs, keys, q_embs, q_keys = batch_and_queue()
    masked = FullConditionalLoss()(head, embs, keys, queue=filled_queue(q_embs, q_keys, 7))
    fresh = {m: 1000 + torch.arange(7) for m in NAMES}  # same vectors, keys never seen
    unmasked = FullConditionalLoss()(head, embs, keys, queue=filled_queue(q_embs, fresh, 7))
    assert masked.loss.item() < unmasked.loss.item()


def test_an_empty_queue_is_the_batch_loss() -> None:
    head = build_head("hclip", NAMES, 5).double()
    embs, keys, _, _ = batch_and_queue()
    plain = FullConditionalLoss()(head, embs, keys)
    queue = NegativesQueue(8, NAMES, 5)
    queue.embs = {m: e.double() for m, e in queue.embs.items()}
    empty = FullConditionalLoss()(head, embs, keys, queue=queue)
    assert empty.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert empty.ceiling_bits == math.log2(5)


def test_the_ring_keeps_the_newest_entries() -> None:
    queue = NegativesQueue(6, ["a"], 2)
    for start in (0, 4, 8):  # three batches of 4 rows: 12 pushed, the last 6 kept
        rows = torch.arange(start, start + 4)
        queue.push({"a": rows[:, None].float().expand(4, 2)}, {"a": rows})
    _, keys = queue.entries()
    assert len(queue) == 6 and sorted(keys["a"].tolist()) == [6, 7, 8, 9, 10, 11]
    big = torch.arange(100, 110)  # a batch larger than the queue: its tail
    queue.push({"a": big[:, None].float().expand(10, 2)}, {"a": big})
    embs, keys = queue.entries()
    assert sorted(keys["a"].tolist()) == list(range(104, 110))
    assert torch.equal(embs["a"][:, 0].long(), keys["a"])


def test_queue_state_round_trips() -> None:
    queue = NegativesQueue(5, NAMES, 3)
    queue.push({m: torch.randn(3, 3) for m in NAMES}, {m: torch.arange(3) for m in NAMES})
    tensors, meta = queue.state()
    other = NegativesQueue(5, NAMES, 3)
    other.load(tensors, meta)
    assert (other.ptr, other.filled) == (3, 3)
    assert all(torch.equal(other.embs[m], queue.embs[m]) for m in NAMES)
