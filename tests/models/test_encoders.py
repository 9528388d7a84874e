"""A `vector` encoder's numpy twin (the service's path for a few rows) equals its torch forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.encoders import VectorEncoder
from models.model import MultimodalModel


def vector_encoder(dim: int, hidden: int | None = None, seed: int = 0) -> VectorEncoder:
    modality = {"kind": "vector", "dim": dim} | ({"hidden": hidden} if hidden else {})
    cfg = ModelConfig.from_dict(
        {"modalities": {"v": modality, "w": {"kind": "vector", "dim": 3}}, "head": "hclip",
         "latent_dim": 16}
    )  # fmt: skip
    torch.manual_seed(seed)
    encoder = MultimodalModel(cfg).encoder("v")
    assert isinstance(encoder, VectorEncoder)
    return encoder


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_numpy_forward_equals_torch(rows: int, scale: float) -> None:
    enc = vector_encoder(12, seed=rows)
    x = (np.random.default_rng(rows).standard_normal((rows, 12)) * scale).astype(np.float32)
    with torch.no_grad():
        want = enc(torch.from_numpy(x)).numpy()
    got = enc.numpy_forward()(x)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_numpy_forward_takes_the_weights_once_and_fails_as_torch_does() -> None:
    enc = vector_encoder(4)
    run = enc.numpy_forward()
    x = np.ones((1, 4), np.float32)
    before = run(x)
    with torch.no_grad():
        enc.proj.weight.mul_(-1.0)  # later training does not reach a function already taken
    np.testing.assert_array_equal(run(x), before)
    huge = np.full((2, 4), 3e38, np.float32)  # overflows inside the MLP, in both
    with torch.no_grad():
        want = enc(torch.from_numpy(huge)).numpy()
    got = enc.numpy_forward()(huge)
    assert not np.isfinite(got).all() and not np.isfinite(want).all()
