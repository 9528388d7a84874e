"""Search service benchmark on a 100k-record flat view. Prints figures; it is not a test.

    python scripts/bench_server.py [--records 100000] [--seconds 8]

Reports, side by side in one run: raw FAISS single-query and batched throughput on the view's
index (one OpenMP thread, as the server runs it), served queries per second and p50/p99 latency
with 1 and with 32 concurrent clients (every query distinct, so nothing comes from the cache),
and the latency of a cache hit. The load comes from wrk (Debian's `wrk`, a C program, with a
Lua script drawing a fresh random query per request) when it is installed, else from an httpx
client, which costs more CPU than the server's own work per request. Either way the load
generator shares the two cores with the server, so served figures are a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_indexer import DIMS, make_model, write_records

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
    return {
        "qps": len(lat) / wall,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "requests": len(lat),
        "non_200": sum(v for k, v in statuses.items() if k != 200),
    }


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
math.randomseed(%d)
request = function()
  local v = {}
  for i = 1, %d do v[i] = string.format("%%.4f", math.random() * 2 - 1) end
  return wrk.format(nil, "/v1/search", nil,
    '{"query": {"%s": [' .. table.concat(v, ",") .. ']}, "k": 10}')
end
"""


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk_load(url: str, concurrency: int, seconds: float, script: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            f.name,
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.unlink(f.name)
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "qps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "non_200": int(bad.group(1)) if bad else 0,
        "load_generator": "wrk",
    }


def served(url: str, pool: list[dict], concurrency: int, seconds: float, seed: int) -> dict:
    if shutil.which("wrk"):
        return wrk_load(
            url, concurrency, seconds, WRK_SCRIPT % (seed, DIMS[VIEW_QUERY], VIEW_QUERY)
        )
    return {**asyncio.run(load(url, pool, concurrency, seconds)), "load_generator": "httpx"}


def cache_hit_latency(url: str, seconds: float) -> dict[str, Any]:
    """One identical request over and over: after the first, every answer is a cache hit."""
    if not shutil.which("wrk"):
        return {**asyncio.run(cache_hits(url, 500)), "load_generator": "httpx"}
    import httpx

    body = query_pool(1, seed=99)[0]
    assert httpx.post(url + "/v1/search", json=body, timeout=10).json()["cached"] is False
    script = (
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{json.dumps(body)}'\n"
        'request = function() return wrk.format(nil, "/v1/search") end\n'
    )
    return wrk_load(url, 1, seconds, script)


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
            [
                sys.executable,
                "-m",
                "app.cli",
                "index",
                "build",
                "--model",
                str(model),
                "--records",
                str(work / "r.jsonl"),
                "--root",
                str(work / "root"),
                "--quiet",
                "--views",
                VIEW_QUERY,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        figures["raw_faiss"] = faiss_figures(work / "root", args.seconds)
        env = {
            **os.environ,
            "HCLIP_ROOT": str(work / "root"),
            "HCLIP_PORT": str(args.port),
            "HCLIP_CACHE_MAX_ITEMS": "100000",
        }
        env.pop("HCLIP_REDIS_URL", None)
        server = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_ready(url, server)
            pool = query_pool(200_000)
            asyncio.run(load(url, pool[-200:], 4, 1.0))  # warm-up, queries not reused below
            figures["served_1_client"] = served(url, pool[:100_000], 1, args.seconds, 1)
            figures["served_32_clients"] = served(url, pool[100_000:199_000], 32, args.seconds, 2)
            figures["cache_hit"] = cache_hit_latency(url, args.seconds / 2)
        finally:
            server.terminate()
            server.wait(10)
    raw = figures["raw_faiss"]
    assert isinstance(raw, dict)
    print(f"records {args.records}, view '{VIEW_QUERY}' (flat, d = 64)")
    print(
        f"raw FAISS, 1 thread: single {raw['faiss_qps_batch1']:.0f} q/s, "
        f"batch 32 {raw['faiss_qps_batch32']:.0f} q/s, batch 64 {raw['faiss_qps_batch64']:.0f} q/s"
    )
    for name in ("served_1_client", "served_32_clients"):
        f = figures[name]
        assert isinstance(f, dict)
        print(
            f"{name}: {f['qps']:.0f} q/s, p50 {f['p50_ms']:.1f} ms, p99 {f['p99_ms']:.1f} ms, "
            f"{f['requests']} requests, {f['non_200']} not 200 ({f['load_generator']})"
        )
    hit = figures["cache_hit"]
    assert isinstance(hit, dict)
    print(f"cache hit: p50 {hit['p50_ms']:.2f} ms, p99 {hit['p99_ms']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
