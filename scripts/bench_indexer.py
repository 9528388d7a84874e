"""Index build benchmark: peak memory against record count and batch size, and throughput
against the bare encoders. Prints figures; it is not a test (this machine is shared and noisy).

    python scripts/bench_indexer.py [--sizes 10000 100000] [--batch-sizes 64 1024]

Each build runs as its own `hclip index build` process, and its peak RSS comes from wait4().
Linux counts a child's resident set from before its exec too, so this parent stays small: it
never imports torch, and the model and the bare-encoder timing run in child processes as well.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DIMS = {"image": 64, "audio": 64, "text": 64}  # `vector` features standing in for backbones


def write_records(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            cols = {
                k: rng.standard_normal((m, d)).astype(np.float32).round(4) for k, d in DIMS.items()
            }
            for i in range(m):
                rec = {"id": f"r{start + i}", "payload": {"i": start + i}}
                rec.update({k: v[i].tolist() for k, v in cols.items()})
                f.write(json.dumps(rec) + "\n")


def make_model(path: Path) -> Path:
    import torch

    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    cfg = ModelConfig.from_dict(
        {
            "modalities": {k: {"kind": "vector", "dim": d} for k, d in DIMS.items()},
            "head": "hclip",
            "latent_dim": 64,
        }
    )
    torch.manual_seed(0)
    return save_model(MultimodalModel(cfg), path, overwrite=True)


def run_build(model: Path, records: Path, root: Path, batch: int) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "index",
        "build",
        "--model",
        str(model),
        "--records",
        str(records),
        "--root",
        str(root),
        "--quiet",
        "--batch-size",
        str(batch),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"build failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def bare_encoder_rate(model_dir: Path, n: int, batch: int) -> float:
    """Records/s through the three encoders alone, inputs already decoded in memory."""
    import torch

    from models.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(model_dir)
    rng = np.random.default_rng(1)
    x = {
        k: torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32)) for k, d in DIMS.items()
    }
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, n, batch):
            for k in DIMS:
                model.encode(k, list(x[k][start : start + batch]))
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per build")
    p.add_argument("--out", type=Path, default=Path("bench-out/indexer.json"))
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _child("make_model", str(work / "model"))
        model = work / "model"
        baseline = run_build(model, _records(work, 10), work / "warm", 64)  # interpreter + torch
        print(f"process baseline (10 records): peak RSS {baseline['peak_rss_mb']:.0f} MB")
        print(
            f"{'records':>9} {'batch':>6} {'peak RSS MB':>12} {'build s':>8} {'build rec/s':>12} "
            f"{'bare encoder rec/s':>19} {'ratio':>6}"
        )
        for n in args.sizes:
            records = _records(work, n)
            for batch in args.batch_sizes:
                r = run_build(model, records, work / f"root-{n}-{batch}", batch)
                bare = float(_child("bare_encoder_rate", str(model), str(n), str(batch)))
                row = {
                    "records": n,
                    "batch": batch,
                    **r,
                    "build_rec_s": n / r["wall_s"],
                    "bare_encoder_rec_s": bare,
                    "ratio": (n / r["wall_s"]) / bare,
                }
                rows.append(row)
                print(
                    f"{n:>9} {batch:>6} {r['peak_rss_mb']:>12.0f} {r['wall_s']:>8.1f} "
                    f"{row['build_rec_s']:>12.0f} {bare:>19.0f} {row['ratio']:>6.2f}"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"baseline": baseline, "runs": rows}, indent=2) + "\n")
    print(f"figures in {args.out}")


def _child(func: str, *args: str) -> str:
    """Run one of this module's functions in a fresh interpreter; its printed result back."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import bench_indexer as b; from pathlib import Path; a = sys.argv[1:]; "
        f"print(b.{func}(Path(a[0]), *map(int, a[1:])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        check=True,
        capture_output=True,
        text=True,
        env=os.environ,
    )
    return out.stdout.strip().splitlines()[-1]


def _records(work: Path, n: int) -> Path:
    path = work / f"records-{n}.jsonl"
    if not path.exists():
        write_records(path, n)
    return path


if __name__ == "__main__":
    main()
