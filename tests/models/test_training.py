"""Training through the DataLoader: lazy records equal in-memory ones, resumption, devices."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.checkpoint import CheckpointError
from models.config import ConfigError, RunConfig
from models.records import RecordError
from models.train.checkpoints import CheckpointStore
from models.train.data import load_training_records
from models.train.records_file import RecordsFile
from models.train.trainer import Trainer, train_model
from tests.conftest import run_cli
from tests.models.media import media_records


def write_config(root: Path, modalities: dict, **train: object) -> Path:
    cfg = {
        "modalities": modalities,
        "latent_dim": 8,
        "train": {"records": "records.jsonl", "epochs": 2, "batch_size": 12, "lr": 0.01} | train,
    }
    path = root / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> RunConfig:
    root = tmp_path_factory.mktemp("media")
    _, modalities = media_records(root, n=48, pool=16)
    return RunConfig.load(write_config(root, modalities))


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=k)


@pytest.mark.parametrize("workers", [0, 2])
def test_lazy_records_and_workers_train_the_in_memory_model(media: RunConfig, workers: int) -> None:
    in_memory = load_training_records(media.records_path, media.model)
    want = train_model(media.model, media.train, in_memory, progress=False)
    lazy = RecordsFile.scan(media.records_path, media.model)
    got = train_model(media.model, replace(media.train, num_workers=workers), lazy, progress=False)
    assert_same_model(got.model, want.model)
    assert got.history == want.history


def test_text_models_train_the_same_with_workers(tmp_path: Path) -> None:
    """With workers, MiniLM's features are made in the workers (featurized batches)."""
    _, modalities = media_records(tmp_path, n=24, pool=8, text=True)
    cfg = RunConfig.load(write_config(tmp_path, modalities, epochs=1))
    data = RecordsFile.scan(cfg.records_path, cfg.model)
    want = train_model(cfg.model, cfg.train, data, progress=False)
    got = train_model(cfg.model, replace(cfg.train, num_workers=2), data, progress=False)
    assert_same_model(got.model, want.model)


def test_resume_ends_where_an_uninterrupted_run_ends(media: RunConfig, tmp_path: Path) -> None:
    """Stopped after step 5 with a checkpoint at step 3; model, optimiser, queue, RNG and the
    data order all continue from there."""
    train = replace(media.train, epochs=3, checkpoint_every=3, queue_size=20, num_workers=2)
    data = RecordsFile.scan(media.records_path, media.model)
    want = train_model(media.model, train, data, progress=False)

    store = CheckpointStore(tmp_path / "checkpoints")
    first = Trainer(media.model, train, data, progress=False, checkpoints=store)
    steps = first.steps()
    for step in steps:
        if step == 5:
            break
    steps.close()
    assert [p.name for p in store.complete()] == ["step-00000003"]

    second = Trainer(media.model, train, data, progress=False, checkpoints=store, resume=True)
    assert second.step == 3 and second.queue is not None and len(second.queue) == 20
    for _ in second.steps():
        pass
    assert_same_model(second.model, want.model)
    assert second.history == want.history

    with pytest.raises(CheckpointError, match=r"train.lr: the checkpoint's run has 0.01, this"):
        Trainer(media.model, replace(train, lr=0.02), data, checkpoints=store, resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Trainer(
            media.model, train, data, checkpoints=CheckpointStore(tmp_path / "none"), resume=True
        )


def test_with_a_queue_momentum_encoders_trail_the_encoders(media: RunConfig) -> None:
    train = replace(media.train, queue_size=24, queue_momentum=0.9)
    data = RecordsFile.scan(media.records_path, media.model)
    trainer = Trainer(media.model, train, data, progress=False)
    assert trainer.momentum is not None and trainer.queue is not None
    start = {k: v.clone() for k, v in trainer.model.encoders.state_dict().items()}
    assert all(torch.equal(v, start[k]) for k, v in trainer.momentum.state_dict().items())
    steps = trainer.steps()
    next(steps)
    online = trainer.model.encoders.state_dict()
    for name, slow in trainer.momentum.state_dict().items():
        torch.testing.assert_close(slow, 0.9 * start[name] + 0.1 * online[name], msg=name)
        assert not torch.equal(slow, online[name])
    assert len(trainer.queue) == 12  # one batch queued
    steps.close()


def test_bf16_autocast_trains_on_the_cpu_when_asked(media: RunConfig) -> None:
    data = RecordsFile.scan(media.records_path, media.model)
    fp32 = train_model(media.model, media.train, data, progress=False)
    bf16 = train_model(media.model, replace(media.train, precision="bf16"), data, progress=False)
    assert torch.isfinite(torch.tensor(bf16.history[-1]["loss"]))
    # It did run in bf16: the same run, rounded differently.
    assert bf16.history[-1]["loss"] != fp32.history[-1]["loss"]
    assert bf16.history[-1]["loss"] == pytest.approx(fp32.history[-1]["loss"], rel=0.05)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_config_error(media: RunConfig, tmp_path: Path, capsys) -> None:
    cfg = json.loads((media.base_dir / "config.json").read_text())
    cfg["train"]["device"] = "cuda"
    (media.base_dir / "cuda.json").write_text(json.dumps(cfg))
    out = tmp_path / "m"
    assert run_cli("train", "--config", media.base_dir / "cuda.json", "--out", out) == 2
    assert "train.device: 'cuda' was asked for, but torch" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("train", "field"),
    [
        ({"device": "tpu"}, "train.device"),
        ({"precision": "fp16"}, "train.precision"),
        ({"num_workers": -1}, "train.num_workers"),
        ({"checkpoint_every": 1.5}, "train.checkpoint_every"),
        ({"queue_size": -4}, "train.queue_size"),
        ({"queue_momentum": 1.0}, "train.queue_momentum"),
    ],
)
def test_bad_train_settings_name_the_field(tmp_path: Path, train: dict, field: str) -> None:
    mods = {"a": {"kind": "vector", "dim": 2}, "b": {"kind": "vector", "dim": 2}}
    with pytest.raises(ConfigError, match=rf"^{field}"):
        RunConfig.load(write_config(tmp_path, mods, **train))


def test_the_queue_needs_the_full_conditional_loss(tmp_path: Path) -> None:
    mods = {"a": {"kind": "vector", "dim": 2}, "b": {"kind": "vector", "dim": 2}}
    path = write_config(tmp_path, mods, queue_size=64, loss="pairwise")
    cfg = json.loads(path.read_text()) | {"head": "clip"}
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^train.queue_size: .* not 'pairwise'"):
        RunConfig.load(path)


def test_a_bad_media_file_stops_the_run_with_its_line(tmp_path: Path, capsys) -> None:
    """Media are decoded when a batch is read, in a worker: the error still names the line."""
    records, modalities = media_records(tmp_path, n=30, pool=4)
    lines = records.read_text().splitlines()
    row = json.loads(lines[16])
    row["image"] = "media/missing.png"
    lines[16] = json.dumps(row)
    records.write_text("\n".join(lines) + "\n")
    cfg = write_config(tmp_path, modalities, num_workers=2)
    out = tmp_path / "m"
    assert run_cli("train", "--config", cfg, "--out", out, "--quiet") == 2
    err = capsys.readouterr().err
    assert "line 17, id 'm-16': image: image file not found:" in err
    assert "Traceback" not in err and not out.exists()


def test_a_records_file_changed_during_training_is_refused(media: RunConfig, tmp_path: Path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(media.records_path.read_bytes())
    data = RecordsFile.scan(path, media.model)
    with open(path, "a") as f:
        f.write("\n")
    with pytest.raises(RecordError, match="changed while training read it"):
        data.batch([0, 1])
