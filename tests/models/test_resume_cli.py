"""`hclip train` killed with SIGKILL after a checkpoint, then `--resume`d: the model it ends
with is the one an uninterrupted run writes, and the kill left nothing in --out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, vector_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def config(tmp: Path) -> Path:
    dims = {"a": 6, "b": 5, "c": 4}
    write_jsonl(tmp / "train.jsonl", vector_records(64, dims))
    cfg = {
        "modalities": {m: {"kind": "vector", "dim": d, "hidden": 16} for m, d in dims.items()},
        "latent_dim": 8,
        "train": {
            "records": "train.jsonl",
            "epochs": 150,  # 1200 steps of a few ms: long enough to be killed midway
            "batch_size": 8,
            "lr": 0.01,
            "checkpoint_every": 40,
            "queue_size": 32,
            "num_threads": 1,
        },
    }
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp / "config.json"


def train_cmd(cfg: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "train", "--config", str(cfg), "--out", str(out),
            "--quiet", *extra]  # fmt: skip


def kill_after_first_checkpoint(cmd: list[str], checkpoints: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith("step-") for p in checkpoints.glob("step-*")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=30)
    return proc


@pytest.mark.slow
def test_sigkill_then_resume_ends_bit_identical(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    whole = tmp_path / "whole"
    assert run_cli("train", "--config", cfg, "--out", whole, "--quiet") == 0

    out = tmp_path / "resumed"
    checkpoints = tmp_path / "resumed.checkpoints"
    killed = kill_after_first_checkpoint(train_cmd(cfg, out), checkpoints)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not out.exists() and not list(tmp_path.glob(".resumed.tmp-*"))
    kept = [p.name for p in checkpoints.iterdir() if p.name.startswith("step-")]
    assert len(kept) == 1 and int(kept[0][5:]) < 1200

    resumed = subprocess.run(
        train_cmd(cfg, out, "--resume"),
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {int(kept[0][5:])}/1200" in resumed.stderr
    assert (out / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    training = [json.loads((d / "config.json").read_text())["training"] for d in (out, whole)]
    assert training[0] == training[1]
    assert not checkpoints.exists()  # removed once the model is in place


def test_checkpoints_of_another_run_are_not_mixed_in(tmp_path: Path, capsys) -> None:
    cfg = config(tmp_path)
    (tmp_path / "m.checkpoints" / "step-00000040").mkdir(parents=True)
    assert run_cli("train", "--config", cfg, "--out", tmp_path / "m", "--quiet") == 2
    assert "holds checkpoints of an earlier run; pass --resume" in capsys.readouterr().err
    assert run_cli("train", "--config", cfg, "--out", tmp_path / "n", "--resume") == 2
    assert f"--resume: no checkpoint in {tmp_path / 'n.checkpoints'}" in capsys.readouterr().err
    inside = ("--checkpoint-dir", tmp_path / "o" / "ck")
    assert run_cli("train", "--config", cfg, "--out", tmp_path / "o", *inside) == 2
    assert "must lie outside --out" in capsys.readouterr().err
