"""Search service benchmark on a 100k-record flat view. Prints figures; it is not a test.

    python scripts/bench_server.py [--records 100000] [--seconds 8]

Reports, side by side in one run: raw FAISS single-query and batched throughput on the view's
index (one OpenMP thread, as the server runs it), served queries per second and p50/p99 latency
with 1 and with 32 concurrent clients (every query distinct, so nothing comes from the cache),
and the latency of a cache hit. The load generator runs on the same two cores as the server,
so served figures are a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_indexer import DIMS, make_model, write_records  # noqa: E402

VIEW_QUERY = "image"  # retrieve audio * text products with an image-side query


def faiss_figures(root: Path, seconds: float) -> dict[str, float]:
    import faiss

    from indexer import artifact
    from indexer.reader import LoadedVersion

    faiss.omp_set_num_threads(1)
    version = LoadedVersion(artifact.current_version_dir(root))
    view = version.views[VIEW_QUERY]
    faiss.cvar.distance_compute_blas_threshold = 3 * view.index.d  # as the server sets it
    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    for nq in (1, 32, 64):
        xq = rng.standard_normal((nq, view.index.d)).astype(np.float32)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            view.search(xq, 10)
            done += nq
        out[f"faiss_qps_batch{nq}"] = done / (time.perf_counter() - t0)
    return out


def query_pool(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, DIMS[VIEW_QUERY])).astype(np.float32).round(4)
    return [{"query": {VIEW_QUERY: v.tolist()}, "k": 10} for v in vecs]


async def load(url: str, bodies: list[dict], concurrency: int, seconds: float) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    it = iter(bodies)
    deadline = time.perf_counter() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            body = next(it)
            t = time.perf_counter()
            r = await client.post("/v1/search", json=body)
            latencies.append(time.perf_counter() - t)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1000
    return {"qps": len(lat) / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "requests": len(lat),
            "non_200": sum(v for k, v in statuses.items() if k != 200)}


async def cache_hits(url: str, n: int) -> dict[str, float]:
    import httpx

    body = query_pool(1, seed=99)[0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        first = (await client.post("/v1/search", json=body)).json()
        assert first["cached"] is False
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            r = (await client.post("/v1/search", json=body)).json()
            lat.append((time.perf_counter() - t) * 1000)
            assert r["cached"] is True
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server never became ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", type=Path, default=Path("bench-out/server.json"))
    args = p.parse_args()
    figures: dict[str, object] = {"records": args.records}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_records(work / "r.jsonl", args.records)
        model = make_model(work / "model")
        subprocess.run(
            [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model), "--records",
             str(work / "r.jsonl"), "--root", str(work / "root"), "--quiet",
             "--views", VIEW_QUERY], check=True, stdout=subprocess.DEVNULL,
        )
        figures["raw_faiss"] = faiss_figures(work / "root", args.seconds)
        env = {**os.environ, "HCLIP_ROOT": str(work / "root"), "HCLIP_PORT": str(args.port),
               "HCLIP_CACHE_MAX_ITEMS": "100000"}
        env.pop("HCLIP_REDIS_URL", None)
        server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_ready(url, server)
            pool = query_pool(200_000)
            asyncio.run(load(url, pool[-200:], 4, 1.0))  # warm-up, queries not reused below
            figures["served_1_client"] = asyncio.run(load(url, pool[:100_000], 1, args.seconds))
            figures["served_32_clients"] = asyncio.run(
                load(url, pool[100_000:199_000], 32, args.seconds))
            figures["cache_hit"] = asyncio.run(cache_hits(url, 500))
        finally:
            server.terminate()
            server.wait(10)
    raw = figures["raw_faiss"]
    assert isinstance(raw, dict)
    print(f"records {args.records}, view '{VIEW_QUERY}' (flat, d = 64)")
    print(f"raw FAISS, 1 thread: single {raw['faiss_qps_batch1']:.0f} q/s, "
          f"batch 32 {raw['faiss_qps_batch32']:.0f} q/s, batch 64 {raw['faiss_qps_batch64']:.0f} q/s")
    for name in ("served_1_client", "served_32_clients"):
        f = figures[name]
        assert isinstance(f, dict)
        print(f"{name}: {f['qps']:.0f} q/s, p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, "
              f"{f['requests']} requests, {f['non_200']} not 200")
    hit = figures["cache_hit"]
    assert isinstance(hit, dict)
    print(f"cache hit: p50 {hit['p50_ms']:.2f} ms, p99 {hit['p99_ms']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
