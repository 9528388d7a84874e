"""Encoder plugins: installed through a real entry point, trained, indexed, fingerprinted.

The example plugin (tests/plugins/hclip_toy_tower.py) is installed the way pip installs a
package: the module and a `*.dist-info` directory whose entry_points.txt names it in the group
`hclip.encoders`, in a directory on sys.path (this process) and PYTHONPATH (subprocesses).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from models.checkpoint import CheckpointError, fingerprint, load_model
from models.config import ConfigError, ModelConfig, RunConfig
from models.encoders import decode
from models.limits import InputError
from models.plugins import resolve_options
from tests.conftest import run_cli, write_jsonl

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "tests" / "plugins" / "hclip_toy_tower.py"
ENTRY_POINTS = "[hclip.encoders]\ntoy_pixels = hclip_toy_tower:ToyPixels\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copy(PLUGIN, site / PLUGIN.name)
    info = site / "hclip_toy_tower-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hclip-toy-tower\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(REPO)]))
    return site


def tower_weights(path: Path, seed: int, size: int = 8, features: int = 16) -> Path:
    """What a user trained elsewhere: here, a seeded random tower."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "0.weight": torch.randn(features, size * size, generator=gen) / size,
        "0.bias": torch.zeros(features),
    }
    save_file(state, str(path))
    return path


def png(symbol: int, rng: np.random.Generator) -> bytes:
    """A 16x16 grey image: the symbol's bar pattern plus noise."""
    arr = np.zeros((16, 16))
    arr[:, 4 * (symbol % 4) : 4 * (symbol % 4) + 4] = 1.0
    arr[4 * (symbol // 4) : 4 * (symbol // 4) + 4, :] += 0.5
    arr = np.clip(arr / 1.5 + 0.1 * rng.standard_normal((16, 16)), 0, 1)
    buf = io.BytesIO()
    Image.fromarray((arr * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_dataset(tmp: Path, n: int = 96, k: int = 8) -> Path:
    rng = np.random.default_rng(0)
    (tmp / "img").mkdir()
    books = {m: rng.standard_normal((k, 4)) for m in ("a", "b")}
    rows = []
    for i in range(n):
        s = int(rng.integers(0, k))
        (tmp / "img" / f"{i}.png").write_bytes(png(s, rng))
        row: dict = {"id": f"p-{i}", "img": f"img/{i}.png", "payload": {"symbol": s}}
        for m, book in books.items():
            row[m] = (book[s] + 0.1 * rng.standard_normal(4)).round(4).tolist()
        rows.append(row)
    return write_jsonl(tmp / "records.jsonl", rows)


def config(tmp: Path, **img: object) -> Path:
    spec = {"kind": "plugin", "plugin": "toy_pixels", "weights": "tower.safetensors"}
    cfg = {
        "modalities": {
            "img": {**spec, "options": {"features": 16}, "hidden": 16, **img},
            "a": {"kind": "vector", "dim": 4, "hidden": 16},
            "b": {"kind": "vector", "dim": 4, "hidden": 16},
        },
        "latent_dim": 8,
        "train": {"records": "records.jsonl", "epochs": 3, "batch_size": 16, "lr": 0.01},
    }
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def cli(*argv: object) -> subprocess.CompletedProcess[str]:
    """`python -m app.cli ...` in a fresh interpreter, which must find the plugin by itself."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )


def test_train_and_index_with_a_plugin_tower(installed: Path, tmp_path: Path) -> None:
    records = write_dataset(tmp_path)
    weights = tower_weights(tmp_path / "tower.safetensors", seed=0)
    cfg = config(tmp_path)
    model_dir = tmp_path / "model"
    assert run_cli("train", "--config", cfg, "--out", model_dir, "--quiet") == 0

    saved = json.loads((model_dir / "config.json").read_text())["modalities"]["img"]
    assert saved["weights"] == str(weights) and saved["options"] == {"size": 8, "features": 16}
    # The frozen tower stays out of the model directory; the head above it is trained.
    model = load_model(model_dir)
    assert not [k for k in model.state_dict() if ".tower" in k]
    assert "encoders.img.head.0.weight" in model.state_dict()
    emb = model.encode("img", [decode("img/3.png", model.cfg.modalities["img"], tmp_path)])
    assert emb.shape == (1, 8)

    built = cli("index", "build", "--model", model_dir, "--records", records, "--root",
                tmp_path / "root", "--quiet")  # fmt: skip
    assert built.returncode == 0, built.stderr
    manifest = next((tmp_path / "root" / "versions").glob("*/manifest.json"))
    assert json.loads(manifest.read_text())["model"]["fingerprint"] == fingerprint(model_dir)

    # The weights are part of the model: new weights, new fingerprint.
    before = fingerprint(model_dir)
    tower_weights(weights, seed=1)
    assert fingerprint(model_dir) != before

    # A missing weights file is named, by the indexer in a fresh process and by the loader.
    weights.unlink()
    failed = cli("index", "build", "--model", model_dir, "--records", records, "--root",
                 tmp_path / "root2", "--quiet")  # fmt: skip
    assert failed.returncode == 2
    assert f"plugin 'toy_pixels' weights file not found: {weights}" in failed.stderr
    with pytest.raises(CheckpointError, match=r"modalities\.img\.weights: plugin 'toy_pixels'"):
        load_model(model_dir)


def test_config_errors_name_the_plugin_field(installed: Path, tmp_path: Path) -> None:
    tower_weights(tmp_path / "tower.safetensors", seed=0)
    model = RunConfig.load(config(tmp_path)).model
    assert ModelConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    # The plugin is looked up, and checks its options, where the model is built.
    with pytest.raises(ConfigError, match=r"^modalities.img.options.features: expected a pos"):
        resolve_options(RunConfig.load(config(tmp_path, options={"features": 0})).model)
    with pytest.raises(ConfigError, match=r"^modalities.img.options.colour: unknown option"):
        resolve_options(RunConfig.load(config(tmp_path, options={"colour": 1})).model)
    with pytest.raises(ConfigError, match=r"^modalities.img.weights: .* not found: .*/nope.st"):
        RunConfig.load(config(tmp_path, weights="nope.st"))
    with pytest.raises(ConfigError, match=r"^modalities.img.plugin: no encoder plugin 'tiny'"):
        resolve_options(RunConfig.load(config(tmp_path, plugin="tiny")).model)


def test_weights_that_do_not_fit_the_tower_are_refused(installed: Path, tmp_path: Path) -> None:
    write_dataset(tmp_path, n=20)
    tower_weights(tmp_path / "tower.safetensors", seed=0, features=12)  # the tower has 16
    assert run_cli("train", "--config", config(tmp_path), "--out", tmp_path / "m", "--quiet") == 2
    assert not (tmp_path / "m").exists()
    torch.save({"0.weight": torch.zeros(1)}, tmp_path / "tower.safetensors")
    with pytest.raises(CheckpointError, match="pickled"):
        from models.checkpoint import build_model

        build_model(RunConfig.load(config(tmp_path)).model)


def test_a_missing_plugin_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the package installed, training stops at the config with the plugin's name."""
    write_dataset(tmp_path, n=20)
    tower_weights(tmp_path / "tower.safetensors", seed=0)
    assert run_cli("train", "--config", config(tmp_path), "--out", tmp_path / "m", "--quiet") == 2
    err = capsys.readouterr().err
    assert "modalities.img.plugin: no encoder plugin 'toy_pixels' is installed" in err
    assert "entry-point group 'hclip.encoders'" in err and not (tmp_path / "m").exists()


def test_a_query_cannot_make_a_plugin_read_a_file(installed: Path, tmp_path: Path) -> None:
    """The service decodes queries with no base directory: paths are refused, data: URIs not."""
    tower_weights(tmp_path / "tower.safetensors", seed=0)
    img = resolve_options(RunConfig.load(config(tmp_path)).model).modalities["img"]
    (tmp_path / "x.png").write_bytes(png(1, np.random.default_rng(0)))
    with pytest.raises(InputError, match="must be a base64 data: URI"):
        decode(str(tmp_path / "x.png"), img, base_dir=None)
    from tests.models.test_inputs import data_uri

    uri = data_uri("image/png", (tmp_path / "x.png").read_bytes())
    assert decode(uri, img, base_dir=None).equal(decode("x.png", img, tmp_path))
