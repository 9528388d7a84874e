"""Peak memory of a process that holds pretrained towers of real sizes, one being fine-tuned.
Prints figures; it is not a test.

    python benchmarks/bench_towers.py --work W --phases bare --records 8   # makes the towers
    python benchmarks/bench_tower_memory.py --work W [--repo CHECKOUT]

Two fresh processes each, the model being ViT-B/16 with its last block fine-tuned (photo) and
wav2vec 2.0 base frozen (sound), the towers bench_towers.py made in W:
- model: building the model, as training, an index build's driver and each server worker do;
- worker: preparing one image for the fine-tuned tower, as a training DataLoader worker does.
`--repo` runs another checkout's code (any version since pretrained towers), for a
before-and-after comparison on one machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import base64, io, json, resource, sys
from PIL import Image
from models.checkpoint import build_model
from models.config import ModelConfig
from models.encoders import decode, featurizer
towers = json.loads(open(sys.argv[1]).read())
cfg = ModelConfig.from_dict({"modalities": {
    "photo": {"kind": "transformers", "model": towers["image"], "input": "image",
              "train_layers": 1},
    "sound": {"kind": "transformers", "model": towers["audio"], "input": "audio",
              "max_seconds": 5}}, "head": "hclip", "latent_dim": 256})
if sys.argv[2] == "model":
    build_model(cfg)
else:
    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (1, 2, 3)).save(buf, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    featurizer(cfg.modalities["photo"])([decode(uri, cfg.modalities["photo"])])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def peak_mb(repo: Path, towers: Path, what: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(towers), what], env=env, cwd=repo,
                         check=True, capture_output=True, text=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="bench_towers.py's --work directory")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code runs")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    towers = args.work / "towers.json"
    if not towers.is_file():
        p.error(f"{towers} is missing: run bench_towers.py --work {args.work} first")
    for what in ("model", "worker"):
        runs = [peak_mb(args.repo.resolve(), towers, what) for _ in range(args.runs)]
        print(f"{what}: peak RSS " + ", ".join(f"{mb:,.0f}" for mb in runs) + " MB")


if __name__ == "__main__":
    main()
