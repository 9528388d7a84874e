"""MultimodalModel's two entry points give the same embeddings."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.model import MultimodalModel


def model() -> MultimodalModel:
    cfg = ModelConfig.from_dict(
        {
            "modalities": {
                "v": {"kind": "vector", "dim": 6},
                "e": {"kind": "embedding", "dim": 5, "map": "linear"},
            },
            "head": "hclip",
            "latent_dim": 8,
        }
    )
    torch.manual_seed(0)
    return MultimodalModel(cfg)


def test_a_stacked_batch_encodes_as_its_rows_do() -> None:
    m = model()
    with torch.no_grad():
        for name, dim in (("v", 6), ("e", 5)):
            x = torch.randn(7, dim)
            torch.testing.assert_close(m.encode_batch(name, x), m.encode(name, list(x)))


def test_a_featurizer_that_does_more_than_stack_still_runs() -> None:
    m = model()
    seen: list[int] = []

    def doubling(items: list[torch.Tensor]) -> torch.Tensor:
        seen.append(len(items))
        return torch.stack(items) * 2

    m.encoder("v").featurizer = doubling
    x = torch.randn(4, 6)
    with torch.no_grad():
        got = m.encode_batch("v", x)
        torch.testing.assert_close(got, m.encoder("v")(x * 2))
    assert seen == [4]
