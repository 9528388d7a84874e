"""Training throughput and memory with 0 and 2 DataLoader workers, at 10k and 100k records.

Records carry an image, an audio clip and a sentence (plus nothing else), the media referenced
by path from a shared pool of small PNG and WAV files, so 100k records stay small on disk and
every record is decoded from its file when its batch is read. For each size and worker count a
child process scans the records (`RecordsFile.scan`), trains `--warmup` steps (MiniLM's sentence
cache and the workers fill up), then times `--steps` steps. Meanwhile this process samples
/proc for the child and its workers: peak RSS of the training process, and the peak of the
summed PSS of all of them (PSS splits pages that forked workers share, so the sum is honest).
`ru_maxrss` from os.wait4 is printed beside it.

    python benchmarks/bench_training.py [--sizes 10000,100000] [--workers 0,2] [--steps 40]

Figures on a shared machine are noisy; memory figures are not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _proc_tree(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def _kb(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Peak RSS of one process and peak summed PSS of its tree, every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak_rss_kb = self.peak_tree_pss_kb = self.max_procs = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            tree = _proc_tree(self.pid)
            rss = _kb(f"/proc/{self.pid}/status", "VmRSS:")
            pss = sum(_kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in tree)
            self.peak_rss_kb = max(self.peak_rss_kb, rss)
            self.peak_tree_pss_kb = max(self.peak_tree_pss_kb, pss)
            self.max_procs = max(self.max_procs, len(tree))
            time.sleep(self.every)


def make_data(root: Path, n: int, pool: int, sentences: int) -> Path:
    """A pool of media files (made once) and a records file of n records over it."""
    import numpy as np

    from tests.models.media import png_file, wav_file

    media = root / "media"
    if not media.is_dir():
        media.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(pool):
            png_file(media / f"{i}.png", rng, size=32)
            wav_file(media / f"{i}.wav", rng, rate=8000, seconds=0.5)
    path = root / f"records-{n}.jsonl"
    rng = np.random.default_rng(n)
    img, aud, txt = (rng.integers(0, k, n) for k in (pool, pool, sentences))
    with open(path, "w") as f:
        for i in range(n):
            row = {
                "id": f"r-{i}",
                "image": f"media/{img[i]}.png",
                "audio": f"media/{aud[i]}.wav",
                "text": f"a recording of item {txt[i]} in the {('red', 'blue')[txt[i] % 2]} box",
            }
            f.write(json.dumps(row) + "\n")
    return path


def write_config(root: Path, records: Path, workers: int, batch: int) -> Path:
    cfg = {
        "modalities": {
            "image": {"kind": "image", "image_size": 32, "conv_width": 16, "hidden": 64},
            "audio": {
                "kind": "audio",
                "sample_rate": 8000,
                "max_seconds": 0.5,
                "n_mels": 32,
                "conv_width": 16,
                "hidden": 64,
            },
            "text": {"kind": "text", "hidden": 64},
        },
        "latent_dim": 64,
        "train": {
            "records": records.name,
            "epochs": 1,
            "batch_size": batch,
            "num_workers": workers,
            "num_threads": 1,
            "log_every": 10**9,
        },
    }
    path = root / f"config-{records.stem}-w{workers}.json"
    path.write_text(json.dumps(cfg))
    return path


def child(config: Path, warmup: int, steps: int) -> None:
    """Runs in the measured process: scan, warm up, time the steps, print one JSON line."""
    from models.config import RunConfig
    from models.train.records_file import RecordsFile
    from models.train.trainer import Trainer

    cfg = RunConfig.load(config)
    t0 = time.perf_counter()
    data = RecordsFile.scan(cfg.records_path, cfg.model)
    scan_s = time.perf_counter() - t0
    trainer = Trainer(cfg.model, cfg.train, data, progress=False)
    it = trainer.steps()
    t0 = time.perf_counter()
    for _ in range(warmup):
        next(it)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    run_s = time.perf_counter() - t0
    it.close()
    print(
        json.dumps(
            {
                "scan_s": scan_s,
                "warmup_s": warm_s,
                "steps_per_s": steps / run_s,
                "tuples_per_s": steps * cfg.train.batch_size / run_s,
            }
        )
    )


def measure(config: Path, warmup: int, steps: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(config), "--warmup", str(warmup)]
    cmd += ["--steps", str(steps)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    sampler.stop.set()
    sampler.join()
    if status != 0:
        raise SystemExit(f"child failed ({status}):\n{err.decode()[-3000:]}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    return result | {
        "peak_rss_mb": sampler.peak_rss_kb / 1024,
        "peak_tree_pss_mb": sampler.peak_tree_pss_kb / 1024,
        "procs": sampler.max_procs,
        "ru_maxrss_mb": usage.ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--pool", type=int, default=2000, help="PNG and WAV files in the pool")
    p.add_argument("--sentences", type=int, default=300, help="distinct sentences")
    p.add_argument("--dir", type=Path, help="where data goes (default: a temporary directory)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.warmup, args.steps)
        return
    root = args.dir or Path(tempfile.mkdtemp(prefix="hclip-bench-training-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"image 32x32 + audio 0.5 s at 8 kHz + text (MiniLM), batch {args.batch_size}, "
        f"pool of {args.pool} PNG/WAV files, {args.sentences} distinct sentences; "
        f"{args.warmup} warm-up steps, then {args.steps} timed; one torch thread per process"
    )
    header = (
        f"{'records':>8} {'workers':>7} {'scan s':>7} {'steps/s':>8} {'tuples/s':>9} "
        f"{'peak RSS MB':>11} {'tree PSS MB':>11} {'procs':>5} {'ru_maxrss MB':>12}"
    )
    print(header)
    for n in (int(s) for s in args.sizes.split(",")):
        records = make_data(root, n, args.pool, args.sentences)
        mb = records.stat().st_size / 1e6
        for w in (int(s) for s in args.workers.split(",")):
            r = measure(write_config(root, records, w, args.batch_size), args.warmup, args.steps)
            print(
                f"{n:>8} {w:>7} {r['scan_s']:>7.2f} {r['steps_per_s']:>8.2f} "
                f"{r['tuples_per_s']:>9.0f} {r['peak_rss_mb']:>11.0f} "
                f"{r['peak_tree_pss_mb']:>11.0f} {r['procs']:>5} {r['ru_maxrss_mb']:>12.0f}",
                flush=True,
            )
        decoded = n * (32 * 32 + 4000 + 384) * 4 / 1e6
        print(
            f"{'':>8} (records file {mb:.1f} MB; decoded into memory, as before, the same records "
            f"would take {decoded:,.0f} MB)"
        )
    print(f"data in {root}")


if __name__ == "__main__":
    main()
