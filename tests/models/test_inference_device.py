"""Where a model encodes for index builds and the service: the device asked for (a GPU when
torch sees one), bf16 autocast where asked, and outputs that are float32 on the CPU whatever
ran them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.checkpoint import load_model
from models.config import ConfigError
from tests.conftest import index_build, make_model_dir, vector_records, write_jsonl

NO_GPU = not torch.cuda.is_available()


def test_bf16_autocast_encodes_close_to_float32(tmp_path: Path) -> None:
    rows = vector_records(32, {"a": 6, "b": 5, "c": 4})
    plain = load_model(make_model_dir(tmp_path / "m"))
    half = load_model(tmp_path / "m").to_inference("cpu", "bf16")
    for name in plain.names:
        items = [torch.tensor(r[name], dtype=torch.float32) for r in rows]
        want = plain.encode(name, items)
        got = half.encode(name, items)
        batch = half.encode_batch(name, torch.stack(items))
        assert got.dtype == batch.dtype == torch.float32 and got.device.type == "cpu"
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
        torch.testing.assert_close(batch, got)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path, capsys) -> None:
    model = load_model(make_model_dir(tmp_path / "m"))
    with pytest.raises(ConfigError, match="HCLIP_DEVICE: 'cuda' was asked for"):
        model.to_inference("cuda", field="HCLIP_DEVICE")
    records = write_jsonl(tmp_path / "r.jsonl", vector_records(8, {"a": 6, "b": 5, "c": 4}))
    assert index_build(tmp_path / "m", records, tmp_path / "root", "--device", "cuda") == 2
    err = capsys.readouterr().err
    assert "--device: 'cuda' was asked for" in err and not (tmp_path / "root" / "CURRENT").exists()


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA device")
def test_cuda_encodes_as_the_cpu_does(tmp_path: Path) -> None:
    rows = vector_records(32, {"a": 6, "b": 5, "c": 4})
    cpu = load_model(make_model_dir(tmp_path / "m"))
    gpu = load_model(tmp_path / "m").to_inference("cuda", "fp32")
    for name in cpu.names:
        items = [torch.tensor(r[name], dtype=torch.float32) for r in rows]
        torch.testing.assert_close(
            gpu.encode(name, items), cpu.encode(name, items), atol=1e-4, rtol=1e-4
        )
