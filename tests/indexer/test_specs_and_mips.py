from __future__ import annotations

import numpy as np
import pytest

from indexer.search.mips import augment, inner_products, pad_queries
from indexer.search.specs import IndexSpec, SpecError


def test_parse_specs() -> None:
    assert IndexSpec.parse("flat").exact
    hnsw = IndexSpec.parse("hnsw:M=16,ef_search=64")
    assert hnsw.params == {"M": 16, "ef_construction": 200, "ef_search": 64}
    assert IndexSpec.from_dict(hnsw.to_dict()) == hnsw
    for bad, msg in [
        ("annoy", "unknown index kind"),
        ("hnsw:efs=3", "takes M=N"),
        ("ivf:nprobe=x", "integer"),
        ("ivf:nprobe=0", "positive"),
    ]:
        with pytest.raises(SpecError, match=msg):
            IndexSpec.parse(bad)


def test_norm_augmentation_turns_mips_into_nearest_neighbour() -> None:
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((300, 6)).astype(np.float32) * rng.random((300, 1)).astype(np.float32)
    xq = rng.standard_normal((20, 6)).astype(np.float32)
    m = float(np.linalg.norm(xb, axis=1).max())
    ab, aq = augment(xb, m, 8), pad_queries(xq, 8)
    assert np.allclose(
        np.linalg.norm(ab, axis=1), m, atol=1e-5
    )  # every stored vector on one sphere
    dist = ((aq[:, None, :] - ab[None]) ** 2).sum(-1)
    ip = xq @ xb.T
    assert np.array_equal(dist.argmin(1), ip.argmax(1))
    assert np.allclose(inner_products(xq, dist, m), ip, atol=1e-4)
