"""A compact version of N records on one machine (default 10M): build it, serve it, and print
what that costs. Prints figures; it is not a test (run it on a quiet machine).

    python benchmarks/bench_compact_scale.py --work DIR [--records 10000000] [--spec sq8:rerank=10]
    python benchmarks/bench_compact_scale.py --work DIR --records 200000 --seconds 5   # smoke

Records: three `embedding` modalities (a, b, c) of d = 128 float32 each, drawn around topics so
that neighbours exist, written to Parquet in row groups of 100,000 (DIR/records.parquet, kept
and reused); the model is an untrained H-CLIP of d = 128 over them (a linear map each).

Printed: the build's wall time and peak RSS (`hclip index build --compact`, a child process);
bytes on disk a record (every file of the version once, hard links counted once); the server's
(`hclip serve --workers W`) RSS per worker, split into anonymous memory and mapped file pages
(which the page cache holds once for every worker), after start and after the loads, with the
page cache (/proc/meminfo `Cached`) and how much it grew; per view, recall@10 through the API on
--queries held-out records (their embeddings sent as `embeddings`) against exact float32 search
over every record (the records' embeddings recomputed in float32 by the model, a chunk of the
Parquet file at a time, merged with faiss.ResultHeap); and, per view, q/s at 32 connections and
p50 at 1 connection (wrk, every query a fresh random vector), at least --searches searches in
all before the last RSS reading.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_compact import LUA, disk_bytes  # noqa: E402  (LUA: a fresh vector a request)
from benchmarks.bench_scale import rss  # noqa: E402
from benchmarks.bench_server import env_for, require_wrk, stop, wait_ready, wrk  # noqa: E402

NAMES = ("a", "b", "c")
DIM = 128
ROW_GROUP = 100_000
K = 10
VIEWS = ("a", "b+c")  # a product view (codes) and an all-but-one view (float16 embeddings)
WRK_TIMEOUT_S = 120.0


def topic_rows(rng: np.random.Generator, centres: dict[str, np.ndarray], m: int) -> dict:
    topic = rng.integers(0, len(centres[NAMES[0]]), m)
    return {k: (c[topic] + 0.5 * rng.standard_normal((m, DIM))).astype(np.float32)
            for k, c in centres.items()}  # fmt: skip


def centres_of(n: int) -> dict[str, np.ndarray]:
    topics = max(1000, n // 1000)
    return {m: np.random.default_rng(100 + i).standard_normal((topics, DIM)).astype(np.float32)
            for i, m in enumerate(NAMES)}  # fmt: skip


def write_parquet(path: Path, n: int, seed: int, prefix: str = "r") -> None:
    """Row groups of ROW_GROUP records: id, a JSON payload, a 128-float list per modality;
    written to a side file and renamed into place whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    centres = centres_of(n)
    tmp = path.with_name(path.name + ".partial")
    writer: Any = None
    try:
        for start in range(0, n, ROW_GROUP):
            m = min(ROW_GROUP, n - start)
            cols: dict[str, Any] = {
                "id": pa.array([f"{prefix}{i}" for i in range(start, start + m)]),
                "payload": pa.array([f'{{"i": {i}}}' for i in range(start, start + m)]),
            }
            for name, values in topic_rows(rng, centres, m).items():
                cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), DIM)
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
    tmp.rename(path)


def make_model(path: Path) -> None:
    import torch

    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    mods = {m: {"kind": "embedding", "dim": DIM, "map": "linear"} for m in NAMES}
    cfg = ModelConfig.from_dict({"modalities": mods, "head": "hclip", "latent_dim": DIM})
    torch.manual_seed(0)
    save_model(MultimodalModel(cfg), path, overwrite=True)


def build(work: Path, spec: str) -> dict[str, Any]:
    root = work / "root"
    if (root / "CURRENT").is_file():
        print("kept the version built before", flush=True)
        return {}
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(work / "model"),
           "--records", str(work / "records.parquet"), "--root", str(root), "--compact",
           "--spec", spec, "--quiet"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env_for(REPO), check=True, stdout=subprocess.DEVNULL)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mb": peak}


def encode(model: Any, table: Any, names: tuple[str, ...]) -> dict[str, Any]:
    import torch

    out = {}
    with torch.no_grad():
        for m in names:
            flat = table.column(m).combine_chunks().flatten().to_numpy()
            rows = np.array(flat.reshape(-1, DIM), dtype=np.float32)  # writable, for torch
            out[m] = model.encode_batch(m, torch.from_numpy(rows))
    return out


def exact_truth(work: Path, queries: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per view, each held-out query's exact float32 top-K record ids over every record."""
    import faiss
    import pyarrow.parquet as pq
    import torch

    from models.checkpoint import load_model
    from models.heads import split_modalities

    model = load_model(work / "model")
    heaps, factors, targets = {}, {}, {}
    for view in VIEWS:
        q, t = split_modalities(model.names, view.split("+"))
        with torch.no_grad():
            factors[view] = model.head.query_factor({m: queries[m] for m in q}, q).numpy()
        targets[view] = t
        heaps[view] = faiss.ResultHeap(len(factors[view]), K, keep_max=True)
    parquet = pq.ParquetFile(work / "records.parquet")
    start = 0
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=list(NAMES))
        embs = encode(model, table, NAMES)
        for view in VIEWS:
            with torch.no_grad():
                xb = model.head.record_factor({m: embs[m] for m in targets[view]}, targets[view])
            d, i = faiss.knn(factors[view], np.ascontiguousarray(xb.numpy()), K,
                             metric=faiss.METRIC_INNER_PRODUCT)  # fmt: skip
            heaps[view].add_result(d, i + start)
        start += table.num_rows
    out = {}
    for view, heap in heaps.items():
        heap.finalize()
        out[view] = heap.I
    return out


def held_out(work: Path, n: int) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from models.checkpoint import load_model

    path = work / "held_out.parquet"
    if not path.is_file():
        write_parquet(path, n, seed=7, prefix="q")
    return encode(load_model(work / "model"), pq.read_table(path), NAMES)


def recall(url: str, queries: dict[str, Any], truth: dict[str, np.ndarray]) -> dict[str, float]:
    import httpx

    out = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for view, want in truth.items():
            hits = 0
            for i in range(len(want)):
                body = {"embeddings": {m: queries[m][i].tolist() for m in view.split("+")},
                        "k": K}  # fmt: skip
                r = client.post("/v1/search", json=body)
                r.raise_for_status()
                got = {int(h["id"][1:]) for h in r.json()["results"]}
                hits += len(got & set(want[i].tolist()))
            out[view] = hits / (K * len(want))
    return out


def cached_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) / 1024
    return 0.0


def workers_of(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def memory(server: subprocess.Popen) -> dict[str, Any]:
    per = {str(w): rss(w) for w in workers_of(server.pid)}
    return {"workers": per, "page_cache_mb": cached_mb()}


def loads(url: str, seconds: float, searches: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    done = 0
    for view in VIEWS:
        names = ",".join(f'"{n}"' for n in view.split("+"))
        wrk(url, 32, min(seconds, 3.0), LUA % (99, names, DIM, K), WRK_TIMEOUT_S)  # warm-up
        many = wrk(url, 32, seconds, LUA % (2, names, DIM, K), WRK_TIMEOUT_S)
        one = wrk(url, 1, seconds, LUA % (3, names, DIM, K), WRK_TIMEOUT_S)
        out[view] = {"qps_32": many["qps"], "p50_1_ms": one["p50_ms"], "p99_1_ms": one["p99_ms"]}
        done += many["requests"] + one["requests"]
    while done < searches:  # the searches the RSS reading is promised after
        more = wrk(url, 32, seconds, LUA % (5 + done, '"a"', DIM, K), WRK_TIMEOUT_S)
        done += more["requests"]
    out["searches"] = done
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="records, model and version")
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--spec", default="sq8:rerank=10", help="the compact version's --spec")
    p.add_argument("--queries", type=int, default=300, help="held-out queries per view")
    p.add_argument("--searches", type=int, default=2000, help="searches before the last RSS")
    p.add_argument("--seconds", type=float, default=20.0, help="each wrk load")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=8793)
    args = p.parse_args()
    require_wrk()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (work / "records.parquet").is_file():
        write_parquet(work / "records.parquet", args.records, seed=0)
        print(f"records written in {time.perf_counter() - t0:.0f} s", flush=True)
    if not (work / "model").is_dir():
        make_model(work / "model")
    built = build(work, args.spec)
    print(f"build: {built}", flush=True)

    from indexer.store import artifact

    vdir = artifact.current_version_dir(work / "root")
    size = disk_bytes(vdir)
    count = artifact.read_manifest(vdir)["counts"]["records"]
    queries = held_out(work, args.queries)
    t0 = time.perf_counter()
    truth = exact_truth(work, queries)
    print(f"exact float32 truth in {time.perf_counter() - t0:.0f} s", flush=True)

    url = f"http://127.0.0.1:{args.port}"
    before = cached_mb()
    env = env_for(REPO, HCLIP_ROOT=str(work / "root"), HCLIP_PORT=str(args.port),
                  HCLIP_CACHE_MAX_BYTES="0")  # fmt: skip
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(args.workers)]
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        t0 = time.perf_counter()
        wait_ready(url, server, limit_s=1800)
        ready_s = time.perf_counter() - t0
        started = memory(server)
        recalls = recall(url, queries, truth)
        served = loads(url, args.seconds, args.searches)
        after = memory(server)
    finally:
        stop(server)
    figures = {
        "records": count, "spec": args.spec, "build": built,
        "bytes_a_record": {k: v / count for k, v in size.items()}, "bytes": size,
        "ready_s": ready_s, "page_cache_before_mb": before, "after_start": started,
        "recall_at_10": recalls, "served": served, "after_loads": after,
    }  # fmt: skip
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
