"""The same vectors and query factors served by this service, a Chroma server and Milvus Lite, at
the same concurrency, with recall@10 against exact search beside every throughput figure.
Prints figures; it is not a test.

    pip install -e '.[peers]'
    python benchmarks/bench_peers.py [--records 100000] [--seconds 8] [--clients 32]

The vectors are those of bench_auto.py: records of three 16-d `vector` modalities showing one
of `--symbols` symbols, an H-CLIP (d = 128) trained on them for one epoch, and the view `a`,
whose stored vectors are the products of b's and c's embeddings. Each system holds exactly
those vectors (this service's flat view; the same array loaded into the others) and gets the
same query factors (omega times a's embedding of fresh queries), so recall and speed compare
the engines alone:

- this service: `hclip serve`, one worker per core, `POST /v1/search` with the query's
  embedding (the server forms the factor), over HTTP;
- Chroma: `chroma run` (its server), HNSW with the `ip` space, M = 32, ef_construction = 200,
  at two ef_search values, through its HTTP client;
- Milvus Lite: FLAT with the IP metric, in this process through pymilvus (Milvus Lite runs
  embedded: the full Milvus, standalone or a cluster, is the production engine).

The load is `--clients` Python threads, each sending one search after another, for every
system alike; the script also prints this service under wrk (a C client) at the same
concurrency, since Python clients on the same cores slow the servers they measure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_auto  # noqa: E402
import bench_server  # noqa: E402

K = 10


def load_test(search: Callable[[int], list[int]], n_queries: int, clients: int,
              seconds: float) -> dict[str, Any]:  # fmt: skip
    """`clients` threads calling search(i) one after another for `seconds`: q/s and p50."""
    stop = time.perf_counter() + seconds
    lat: list[float] = []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def client() -> None:
        mine = []
        while time.perf_counter() < stop:
            i = next(counter) % n_queries
            t = time.perf_counter()
            search(i)
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    took = time.perf_counter() - t0
    return {"qps": len(lat) / took, "p50_ms": float(np.median(lat)) * 1e3, "requests": len(lat)}


def recall(found: list[list[int]], truth: np.ndarray) -> float:
    shares = [len(set(f) & set(t.tolist())) / K for f, t in zip(found, truth, strict=True)]
    return float(np.mean(shares))


def chroma(work: Path, xb: np.ndarray, port: int) -> tuple[subprocess.Popen, Any, float]:
    import chromadb

    exe = shutil.which("chroma") or str(Path(sys.executable).parent / "chroma")
    server = subprocess.Popen(
        [exe, "run", "--path", str(work / "chroma"), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        try:
            client = chromadb.HttpClient(host="127.0.0.1", port=port)
            client.heartbeat()
            break
        except Exception:
            time.sleep(0.1)
    coll = client.create_collection(
        "view", configuration={"hnsw": {"space": "ip", "max_neighbors": 32, "ef_construction": 200}}
    )
    t0 = time.perf_counter()
    for start in range(0, len(xb), 5000):
        part = xb[start : start + 5000]
        coll.add(ids=[str(start + i) for i in range(len(part))], embeddings=part.tolist())
    return server, coll, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--symbols", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--port", type=int, default=8785)
    p.add_argument("--out", type=Path, default=Path("bench-out/peers.json"))
    args = p.parse_args()
    bench_server.require_wrk()
    sys.path.insert(0, str(REPO))
    import torch
    from pymilvus import MilvusClient

    from indexer.search import exact
    from indexer.store import artifact
    from models.checkpoint import load_model

    cores = len(os.sched_getaffinity(0))
    gen = bench_auto.Generator(args.symbols)
    figures: dict[str, Any] = {"records": args.records, "cpu": bench_server.cpu_model(),
                               "cores": cores, "clients": args.clients}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records = work / "records.jsonl"
        bench_auto.write_records(records, gen, args.records)
        model_dir = bench_auto.train(work, records, min(20_000, args.records))
        root = bench_auto.build(work, model_dir, records, "flat")
        vdir = artifact.current_version_dir(root)
        xb = np.ascontiguousarray(np.load(vdir / "views" / f"{bench_auto.QUERY}.npy"))
        rows = np.load(vdir / "views" / f"{bench_auto.QUERY}.rows.npy")
        model = load_model(model_dir)
        bodies = bench_auto.bodies_of(gen, 2000, seed=11)
        raw = torch.tensor([b["query"][bench_auto.QUERY] for b in bodies])
        with torch.inference_mode():
            embs = model.encode_batch(bench_auto.QUERY, raw)
            xq = model.head.query_factor({bench_auto.QUERY: embs}, (bench_auto.QUERY,)).numpy()
        _, truth = exact.search(xq, xb, K)  # positions in the view
        results: dict[str, Any] = {}

        # this service
        port = args.port
        server = bench_auto.serve(root, port, cores)
        url = f"http://127.0.0.1:{port}"
        try:
            bench_server.wait_ready(url, server)
            import httpx

            ours = [{"embeddings": {bench_auto.QUERY: e.tolist()}, "k": K} for e in embs.numpy()]
            clients = threading.local()
            row_of = {f"r{int(r)}": pos for pos, r in enumerate(rows)}  # record id -> position

            def search_ours(i: int) -> list[int]:
                c = getattr(clients, "c", None) or httpx.Client(base_url=url, timeout=60)
                clients.c = c
                hits = c.post("/v1/search", json=ours[i]).json()["results"]
                return [row_of[h["id"]] for h in hits]

            found = [search_ours(i) for i in range(300)]
            results["hclip flat"] = {
                "recall_at_10": recall(found, truth[:300]),
                **load_test(search_ours, len(ours), args.clients, args.seconds),
                "wrk": bench_server.wrk(url, args.clients, args.seconds,
                                        bench_auto.wrk_script([json.dumps(b) for b in ours])),
            }  # fmt: skip
        finally:
            server.terminate()
            server.wait(60)

        # Chroma
        cserver, coll, load_s = chroma(work, xb, args.port + 1)
        try:
            for ef in (100, 400):
                coll.modify(configuration={"hnsw": {"ef_search": ef}})

                def search_chroma(i: int) -> list[int]:
                    got = coll.query(query_embeddings=[xq[i].tolist()], n_results=K)
                    return [int(x) for x in got["ids"][0]]

                found = [search_chroma(i) for i in range(300)]
                results[f"chroma hnsw ef_search={ef}"] = {
                    "recall_at_10": recall(found, truth[:300]),
                    "load_s": load_s,
                    **load_test(search_chroma, len(xq), args.clients, args.seconds),
                }
        finally:
            cserver.terminate()
            cserver.wait(60)

        # Milvus Lite
        client = MilvusClient(str(work / "milvus.db"))
        client.create_collection("view", dimension=xb.shape[1], metric_type="IP",
                                 index_params=None, auto_id=False)  # fmt: skip
        t0 = time.perf_counter()
        for start in range(0, len(xb), 10_000):
            part = xb[start : start + 10_000]
            client.insert("view", [{"id": start + i, "vector": v.tolist()}
                                   for i, v in enumerate(part)])  # fmt: skip
        client.flush("view")
        load_s = time.perf_counter() - t0

        def search_milvus(i: int) -> list[int]:
            got = client.search("view", data=[xq[i].tolist()], limit=K)
            return [int(h["id"]) for h in got[0]]

        found = [search_milvus(i) for i in range(300)]
        results["milvus lite flat"] = {
            "recall_at_10": recall(found, truth[:300]),
            "load_s": load_s,
            **load_test(search_milvus, len(xq), args.clients, args.seconds),
        }
        client.close()
    figures["results"] = results
    print(f"CPU: {figures['cpu']}; {cores} cores; {args.records} vectors of d = {xb.shape[1]}; "
          f"{args.clients} clients")  # fmt: skip
    for name, r in results.items():
        extra = f", under wrk {r['wrk']['qps']:.0f} q/s" if "wrk" in r else ""
        load = f", loaded in {r['load_s']:.0f} s" if "load_s" in r else ""
        print(f"  {name:<28} recall@10 {r['recall_at_10']:.3f}  {r['qps']:>7.0f} q/s  "
              f"p50 {r['p50_ms']:.1f} ms{extra}{load}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
