"""`--spec auto` against flat search, served: throughput and latency under the server's own
load, and recall@10 through the API on queries the tuner never saw. Prints figures; it is not a
test (a shared machine is noisy: compare figures taken in one run).

    python benchmarks/bench_auto.py [--records 100000] [--seconds 8]
    python benchmarks/bench_auto.py --records 1000000

The data: records of three 16-d `vector` modalities (a, b, c), each a noisy view of one of
`--symbols` symbols (a shared factor), and an H-CLIP (d = 128) trained on them for one epoch;
the view searched is `a`, whose record vectors are the products of b's and c's embeddings.
Two versions of the same records are built, `--spec flat` and `--spec auto:recall=0.95`, and
each is served by `hclip serve` with one worker per core. wrk sends fresh queries drawn from
the same generator as the records (none of them among the records, so none among the tuner's
queries) at 32 connections and at 1; recall@10 compares the top-10 ids each version returns
for 300 more fresh queries, through the API.
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
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (the shared helpers: wrk, readiness, the CPU)

DIMS = {"a": 16, "b": 16, "c": 16}
QUERY = "a"


class Generator:
    """Records and queries from one distribution: a symbol, seen by each modality through its
    own random codebook plus noise."""

    def __init__(self, symbols: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.books = {m: rng.standard_normal((symbols, d)) for m, d in DIMS.items()}
        self.symbols = symbols

    def draw(self, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        s = rng.integers(0, self.symbols, n)
        return {m: (b[s] + 0.3 * rng.standard_normal((n, b.shape[1]))).astype(np.float32)
                for m, b in self.books.items()}  # fmt: skip


def write_records(path: Path, gen: Generator, n: int) -> None:
    import orjson

    rng = np.random.default_rng(1)
    with open(path, "wb") as f:
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            cols = gen.draw(m, rng)
            lines = [
                orjson.dumps({"id": f"r{start + i}", **{k: v[i].round(4).tolist()
                                                         for k, v in cols.items()}})
                for i in range(m)
            ]  # fmt: skip
            f.write(b"\n".join(lines) + b"\n")


def train(work: Path, records: Path, train_records: int) -> Path:
    head = work / "train.jsonl"
    with open(records, "rb") as src, open(head, "wb") as dst:
        for i, line in enumerate(src):
            if i >= train_records:
                break
            dst.write(line)
    config = {
        "modalities": {m: {"kind": "vector", "dim": d} for m, d in DIMS.items()},
        "head": "hclip",
        "latent_dim": 128,
        "train": {"records": str(head), "epochs": 1, "batch_size": 256, "lr": 0.003},
    }
    (work / "config.json").write_text(json.dumps(config))
    model = work / "model"
    subprocess.run(
        [sys.executable, "-m", "app.cli", "train", "--config", str(work / "config.json"),
         "--out", str(model), "--quiet", "--overwrite"],
        cwd=REPO, env=bench_server.env_for(REPO), check=True,
    )  # fmt: skip
    return model


def build(work: Path, model: Path, records: Path, spec: str) -> Path:
    root = work / f"root-{spec.split(':')[0]}"
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model), "--records",
         str(records), "--root", str(root), "--quiet", "--views", QUERY, "--spec", spec],
        cwd=REPO, env=bench_server.env_for(REPO), check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    print(f"built {spec} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def wrk_script(bodies: list[str]) -> str:
    table = ",\n".join(f"  '{b}'" for b in bodies)
    return (
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"bodies = {{\n{table}\n}}\ni = 0\n"
        "request = function()\n  i = i % #bodies + 1\n"
        '  return wrk.format(nil, "/v1/search", nil, bodies[i])\nend\n'
    )


def bodies_of(gen: Generator, n: int, seed: int) -> list[dict[str, Any]]:
    q = gen.draw(n, np.random.default_rng(seed))[QUERY]
    return [{"query": {QUERY: v.round(4).tolist()}, "k": 10} for v in q]


def ids(url: str, bodies: list[dict[str, Any]]) -> list[list[str]]:
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        return [[h["id"] for h in c.post("/v1/search", json=b).json()["results"]] for b in bodies]


def serve(root: Path, port: int, workers: int) -> subprocess.Popen:
    env = bench_server.env_for(REPO, HCLIP_ROOT=str(root), HCLIP_PORT=str(port),
                               HCLIP_CACHE_MAX_ITEMS="1", HCLIP_CACHE_MAX_BYTES="0")  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--symbols", type=int, default=1000, help="symbols the records show")
    p.add_argument("--train-records", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--port", type=int, default=8775)
    p.add_argument("--out", type=Path, default=Path("bench-out/auto.json"))
    args = p.parse_args()
    bench_server.require_wrk()
    cores = len(os.sched_getaffinity(0))
    gen = Generator(args.symbols)
    figures: dict[str, Any] = {"records": args.records, "cpu": bench_server.cpu_model(),
                               "cores": cores}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records = work / "records.jsonl"
        write_records(records, gen, args.records)
        model = train(work, records, min(args.train_records, args.records))
        roots = {spec: build(work, model, records, spec) for spec in ("flat", "auto:recall=0.95")}
        load = wrk_script([json.dumps(b) for b in bodies_of(gen, 2000, seed=7)])
        check = bodies_of(gen, 300, seed=8)
        found: dict[str, list[list[str]]] = {}
        for i, (spec, root) in enumerate(roots.items()):
            port = args.port + i
            url = f"http://127.0.0.1:{port}"
            server = serve(root, port, cores)
            try:
                t0 = time.perf_counter()
                bench_server.wait_ready(url, server)
                ready = time.perf_counter() - t0
                bench_server.wrk(url, 32, 2.0, load)  # warm-up
                found[spec] = ids(url, check)
                import httpx

                info = httpx.get(url + "/v1/info", timeout=30).json()["views"][QUERY]
                figures[spec] = {
                    "ready_s": ready,
                    "view": info,
                    "32_connections": bench_server.wrk(url, 32, args.seconds, load),
                    "1_connection": bench_server.wrk(url, 1, args.seconds, load),
                }
            finally:
                server.terminate()
                server.wait(60)
    exact = found["flat"]
    for spec in roots:
        hits = [len(set(a) & set(b)) / 10 for a, b in zip(found[spec], exact, strict=True)]
        figures[spec]["recall_at_10_api"] = float(np.mean(hits))
    print(f"CPU: {figures['cpu']}; {cores} cores; {args.records} records, view {QUERY!r}, d = 128")
    flat_qps = figures["flat"]["32_connections"]["qps"]
    for spec in roots:
        f = figures[spec]
        many, one = f["32_connections"], f["1_connection"]
        print(f"{spec}: serves {f['view']['spec']}; recall@10 through the API "
              f"{f['recall_at_10_api']:.3f} on 300 unseen queries")  # fmt: skip
        print(f"  32 connections: {many['qps']:.0f} q/s ({many['qps'] / flat_qps:.2f}x flat), "
              f"p50 {many['p50_ms']:.2f} ms; 1 connection p50 {one['p50_ms']:.2f} ms")  # fmt: skip
        tuning = f["view"].get("tuning")
        if tuning:
            print(f"  the tuner compared, in batches of {tuning.get('served_batch')}: "
                  f"{json.dumps(tuning.get('check'))}; flat {json.dumps(tuning.get('flat'))}"
                  + (f"; {tuning['why']}" if "why" in tuning else ""))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
