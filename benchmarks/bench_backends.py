"""Served throughput and latency through each view backend, on the same machine, records, model
and view: `faiss` (memory-mapped files) and `milvus` (collections in a Milvus Lite server, its
own process, on the same cores). Prints figures; it is not a test.

    python benchmarks/bench_backends.py [--records 100000] [--seconds 8] [--workers 1]

One Milvus Lite server on one machine is slower than local memory maps: the figure is for
honesty; the point of the milvus backend is serving beyond one machine (docs/milvus.md).
Every query is distinct (no cache hit); wrk drives the load from the same cores.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_server import (
    DIMS,
    QUERY,
    REPO,
    WRK_SCRIPT,
    cpu_model,
    env_for,
    make_model,
    wait_ready,
    write_records,
    wrk,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_milvus(data: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "milvus_lite",
            "server",
            "--data-dir",
            str(data),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("milvus-lite server did not start")


def build(work: Path, name: str, *extra: str) -> tuple[Path, float]:
    root = work / f"root-{name}"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "index",
        "build",
        "--model",
        str(work / "model"),
        "--records",
        str(work / "records.jsonl"),
        "--root",
        str(root),
        "--quiet",
        "--views",
        QUERY,
        *extra,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env_for(REPO), check=True, stdout=subprocess.DEVNULL)
    return root, time.perf_counter() - t0


def serve(root: Path, workers: int, seconds: float) -> dict[str, Any]:
    port = free_port()
    env = env_for(REPO, HCLIP_ROOT=str(root), HCLIP_PORT=str(port))
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_ready(url, server)
        ready = time.perf_counter() - t0
        dim = DIMS[QUERY]
        wrk(url, 8, 2.0, WRK_SCRIPT % (97, dim, QUERY))  # warm-up, its queries not reused
        one = wrk(url, 1, seconds, WRK_SCRIPT % (3, dim, QUERY))
        many = wrk(url, 32, seconds, WRK_SCRIPT % (4, dim, QUERY))
        return {"ready_s": ready, "1_connection": one, "32_connections": many}
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--latent", type=int, default=128)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-out/backends.json"))
    args = p.parse_args()
    print(
        f"CPU: {cpu_model()}; {args.records} records, d = {args.latent}, view {QUERY!r}, "
        f"{args.workers} worker(s), wrk on the same cores"
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_records(work / "records.jsonl", args.records)
        make_model(work / "model", args.latent, REPO)
        milvus_port = free_port()
        milvus = start_milvus(work / "milvus-data", milvus_port)
        try:
            for name, extra in (
                ("faiss", ()),
                (
                    "milvus",
                    ("--backend", "milvus", "--milvus-uri", f"http://127.0.0.1:{milvus_port}"),
                ),
            ):
                root, took = build(work, name, *extra)
                r = serve(root, args.workers, args.seconds)
                r["build_s"] = took
                results[name] = r
                one, many = r["1_connection"], r["32_connections"]
                print(
                    f"{name:>6}: build {took:6.1f} s; ready {r['ready_s']:.2f} s; 1 connection "
                    f"{one['qps']:7.0f} q/s p50 {one['p50_ms']:6.2f} ms; 32 connections "
                    f"{many['qps']:7.0f} q/s p50 {many['p50_ms']:6.2f} ms p99 "
                    f"{many['p99_ms']:6.2f} ms; {one['non_2xx'] + many['non_2xx']} not 2xx"
                )
        finally:
            milvus.kill()
            milvus.wait()
    f, m = results["faiss"]["32_connections"]["qps"], results["milvus"]["32_connections"]["qps"]
    print(f"milvus / faiss at 32 connections: {m / f:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
