"""Approximate search on H-CLIP products: the tuner's measured frontier (recall@10 against
single-query and batched speed, bytes per record, build time) and its pick, at 100k and 1M
records, on the products of a trained and of an untrained model. Prints figures; it is not a
test (this machine is shared and noisy: compare the ratios of one run, measured side by side).

    python benchmarks/bench_ann.py                                   # 100k and 1M, both models
    python benchmarks/bench_ann.py --records 100000 --out docs/ann   # the quick run, written out

The data: the expressivity benchmark's pure-interaction task (benchmarks/expressivity.py:
K = 32 symbols, a and b uniform, c = (a + b) mod K, each modality a 16-d codebook row plus
noise 0.3), with d = 128. "trained": an H-CLIP trained on 8,192 tuples of it (--epochs);
"untrained": the same architecture with its initial random weights (the hard case: no cluster
structure for an index to exploit). Records are fresh tuples; the view queries with a and
stores the Hadamard products b * c (not unit length); its queries are omega * a of sampled
records, as `hclip index build --spec auto` forms them.

Each (model, size) runs indexer.build.views.build_view with an `auto` spec, the code path of a
build: the flat vectors are written, the tuner measures every candidate family on one FAISS
thread (see indexer/tune/tuner.py), picks, and writes the index. `--explore-to` makes each
sweep continue past the target so the frontier shows more of each curve.

With --out DIR: DIR/results.json (every figure), DIR/results.md (the tables) and
DIR/frontier.png (one panel per model and size).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.expressivity import Synth, make_dataset, tasks  # noqa: E402
from indexer.build.views import build_view  # noqa: E402
from indexer.search.specs import IndexSpec  # noqa: E402
from indexer.store.arrays import NpyAppender  # noqa: E402
from indexer.store.rows import StoredRows  # noqa: E402
from indexer.tune.tuner import TuneOptions  # noqa: E402
from models.config import ModalityConfig, ModelConfig, TrainConfig  # noqa: E402
from models.model import MultimodalModel  # noqa: E402
from models.train.trainer import train_model  # noqa: E402

K_SYMBOLS, INPUT_DIM, NOISE, LATENT, HIDDEN = 32, 16, 0.3, 128, 128
ENCODE_CHUNK = 65536


def make_model(trained: bool, epochs: int, seed: int = 0) -> MultimodalModel:
    task = next(t for t in tasks(K_SYMBOLS) if t.name == "pure_interaction")
    mods = {n: ModalityConfig(kind="vector", dim=INPUT_DIM, hidden=HIDDEN) for n in task.names}
    cfg = ModelConfig(modalities=mods, head="hclip", latent_dim=LATENT)
    if not trained:
        torch.manual_seed(seed)
        return MultimodalModel(cfg).eval()
    synth = Synth.make(task.names, K_SYMBOLS, INPUT_DIM, NOISE, seed)
    rng = np.random.default_rng(seed + 1)
    sym = task.symbols(rng, 8192)
    data = make_dataset(synth.inputs(sym, rng), sym)
    tcfg = TrainConfig(
        records="<synthetic>",
        epochs=epochs,
        batch_size=256,
        lr=3e-3,
        seed=seed,
        log_every=10**9,
        num_threads=1,
        device="cpu",
    )
    return train_model(cfg, tcfg, data, progress=False).model.eval()


@torch.no_grad()
def write_embeddings(model: MultimodalModel, n: int, vdir: Path, seed: int = 2) -> StoredRows:
    """n fresh tuples through the model's encoders into vdir/embeddings/<m>.npy (as a build
    writes them); the StoredRows a build job would pass to build_view."""
    task = next(t for t in tasks(K_SYMBOLS) if t.name == "pure_interaction")
    synth = Synth.make(task.names, K_SYMBOLS, INPUT_DIM, NOISE, 0)  # the training codebooks
    rng = np.random.default_rng(seed)
    (vdir / "embeddings").mkdir(parents=True)
    (vdir / "views").mkdir()
    writers = {m: NpyAppender(vdir / "embeddings" / f"{m}.npy", LATENT) for m in task.names}
    for start in range(0, n, ENCODE_CHUNK):
        x = synth.inputs(task.symbols(rng, min(ENCODE_CHUNK, n - start)), rng)
        for m, w in writers.items():
            w.append(model.encoders[m](x[m]).numpy())
    for w in writers.values():
        w.close()
    embeddings = {m: np.load(vdir / "embeddings" / f"{m}.npy", mmap_mode="r") for m in writers}
    return StoredRows(list(task.names), embeddings, np.ones((n, len(writers)), dtype=bool))


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), "?"
        )
    except OSError:
        cpu = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "faiss": __import__("faiss").__version__,
        "torch": torch.__version__,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "load_average_at_start": list(os.getloadavg()),
    }


def run_one(
    kind: str, model: MultimodalModel, n: int, target: float, explore_to: float | None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-ann-{kind}-{n}-"))
    try:
        t0 = time.perf_counter()
        stored = write_embeddings(model, n, tmp)
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        opts = TuneOptions(explore_to=explore_to)
        spec = IndexSpec("auto", {}, target)
        entry = build_view(tmp, model.head, stored, ("a",), spec, opts)
        seconds = time.perf_counter() - t0
        b, c = (np.load(tmp / "embeddings" / f"{m}.npy", mmap_mode="r")[:10000] for m in "bc")
        norms = np.linalg.norm(b * c, axis=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model": kind,
        "records": n,
        "encode_s": round(encode_s, 1),
        "build_view_s": round(seconds, 1),
        "product_norms": {q: round(float(np.quantile(norms, q / 100)), 4) for q in (1, 50, 99)},
        "spec": entry["spec"],
        "recall_at_10": entry["recall_at_10"],
        "tuning": entry["tuning"],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
    }


def table(run: dict[str, Any]) -> str:
    t = run["tuning"]
    flat = t["flat"]
    lines = [
        f"### {run['model']} model, {run['records']:,} records (d = {LATENT})",
        "",
        f"Flat: {flat['qps_single']:.0f} q/s one at a time (FAISS scan), {flat['qps_batch']:.0f} "
        f"q/s in batches of {t['timing']['batch']} ({flat['batch_kernel']}), "
        f"{flat['bytes_per_record']:.0f} B/record. Picked for recall@10 >= {t['target_recall']}: "
        f"**{t['picked']}**, recall@10 {t['check']['recall_at_10']} on {t['check']['queries']} "
        f"check queries, {t['check']['speedup_single']}x flat single-query, "
        f"{t['check']['speedup_batch']}x batched" + (f" ({t['why']})" if "why" in t else "") + ".",
        "",
        "| index | effort | recall@10 | q/s single | x flat | q/s batch | x flat | B/record "
        "| build s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in t["frontier"]:
        mark = "**" if p["spec"] == t["picked"] else ""
        structure = p["structure"]
        lines.append(
            f"| {mark}{structure}{mark} | {p['effort']} | {p['recall_at_10']:.3f} | "
            f"{p['qps_single']:.0f} | {p['speedup_single']:.1f} | {p['qps_batch']:.0f} | "
            f"{p['qps_batch'] / flat['qps_batch']:.1f} | {p['bytes_per_record']:.0f} | "
            f"{p['build_s']:.0f} |"
        )
    lines += ["", "Structures: " + "; ".join(f"`{k}`: {v}" for k, v in t["structures"].items()), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument(
        "--models", nargs="+", default=["trained", "untrained"], choices=["trained", "untrained"]
    )
    p.add_argument("--recall", type=float, default=0.95, help="the tuner's target")
    p.add_argument(
        "--explore-to", type=float, default=0.99, help="sweep each index up to this recall"
    )
    p.add_argument("--epochs", type=int, default=4, help="training epochs of the trained model")
    p.add_argument("--out", type=Path, help="write results.json, results.md, frontier.png here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("faiss.contrib.exhaustive_search").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    info = machine()
    started = time.perf_counter()
    runs = []
    for kind in args.models:
        model = make_model(kind == "trained", args.epochs)
        for n in args.records:
            print(f"== {kind} model, {n:,} records", flush=True)
            run = run_one(kind, model, n, args.recall, args.explore_to)
            runs.append(run)
            print(table(run), flush=True)
    info["load_average_at_end"] = list(os.getloadavg())
    info["total_s"] = round(time.perf_counter() - started, 1)
    start, end = info["load_average_at_start"], info["load_average_at_end"]
    print(f"total {info['total_s']:.0f} s; load average {start} -> {end}")
    if args.out:
        from indexer.tune.frontier_plot import plot_panels

        args.out.mkdir(parents=True, exist_ok=True)
        settings = vars(args) | {"out": str(args.out), "latent": LATENT, "symbols": K_SYMBOLS}
        (args.out / "results.json").write_text(
            json.dumps({"machine": info, "settings": settings, "runs": runs}, indent=1) + "\n"
        )
        header = (
            "# Approximate search on H-CLIP products\n\n"
            f"`python benchmarks/bench_ann.py --records {' '.join(map(str, args.records))} "
            f"--out {args.out}` on {info['cpu']} ({info['cores']} cores, shared; load average "
            f"{start[0]:.1f} at start, {end[0]:.1f} at end), {info['total_s'] / 60:.0f} min in "
            "all. One FAISS thread; speeds are ratios to flat search measured in the same run.\n\n"
        )
        (args.out / "results.md").write_text(header + "\n".join(table(r) for r in runs))
        panels = [(f"{r['model']} model, {r['records']:,} records", r["tuning"]) for r in runs]
        plot_panels(panels, args.out / "frontier.png", cols=len(args.records))
        print(f"wrote {args.out}/results.json, results.md, frontier.png")


if __name__ == "__main__":
    main()
