"""Encoding validated rows: (n, d) float32 embeddings per modality, a batch at a time."""

from __future__ import annotations

import numpy as np
import torch

from indexer.ingest.validate import Rows
from models.model import MultimodalModel
from models.records import RecordError


@torch.no_grad()
def encode_rows(model: MultimodalModel, rows: Rows, batch_size: int) -> dict[str, np.ndarray]:
    """(n, d) float32 per modality, zero where a row lacks it; `batch_size` rows per encoder
    call. A model that outputs NaN or infinity stops the job: it must not reach an index."""
    out = {}
    for j, name in enumerate(model.names):
        present = np.flatnonzero(rows.presence[:, j])
        everyone = len(present) == len(rows)  # the common case: slices, not gathers
        full = np.zeros((len(rows), model.cfg.latent_dim), dtype=np.float32)
        values = rows.inputs[name]
        for start in range(0, len(present), batch_size):
            idx = present[start : start + batch_size]
            at = slice(start, start + len(idx)) if everyone else idx
            if isinstance(values, np.ndarray):
                emb = _encode_array(model, name, values[at])
            else:
                emb = model.encode(name, [values[i] for i in idx])
            full[at] = emb.numpy()
        if not np.isfinite(full).all():
            raise RecordError(f"encoder {name!r} produced non-finite values in this batch")
        out[name] = full
    return out


def _encode_array(model: MultimodalModel, name: str, x: np.ndarray) -> torch.Tensor:
    # The batch goes to the encoder as it is (MultimodalModel.encode_batch): splitting it into
    # one tensor per row for the featurizer to stack back cost a third of the encoding time.
    batch = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return model.encode_batch(name, batch)
