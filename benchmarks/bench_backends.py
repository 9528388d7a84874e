"""Served throughput and latency through each view backend, on the same machine, records, model
and view, all exact (flat: recall 1.0): `faiss` (memory-mapped files), `milvus-lite`
(collections in a Milvus Lite server) and `milvus-standalone` (collections in Milvus
standalone, the real engine, from the `milvus` package: the milvus-server extra), each Milvus
in its own process on the same cores. Prints figures; it is not a test.

    python benchmarks/bench_backends.py [--records 100000] [--seconds 8] [--workers 1]
        [--backends faiss,milvus-lite,milvus-standalone]

One Milvus on one machine is slower than local memory maps: the figure is for honesty; the
point of the milvus backend is serving beyond one machine (docs/milvus.md). Every query is
distinct (no cache hit); wrk drives the load from the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
    require_wrk,
    wait_ready,
    write_records,
    wrk,
)
from benchmarks.milvus_servers import Lite, Standalone, free_port

BACKENDS = ("faiss", "milvus-lite", "milvus-standalone")


@contextlib.contextmanager
def backend(name: str, work: Path) -> Iterator[tuple[str, ...]]:
    """The build options that put a root on `name`, its Milvus running meanwhile."""
    if name == "faiss":
        yield ()
        return
    server = Lite(work / "lite-data") if name == "milvus-lite" else Standalone(work / "standalone")
    server.start()
    try:
        yield ("--backend", "milvus", "--milvus-uri", server.uri)
    finally:
        server.stop()


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
    p.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS)
    )
    args = p.parse_args()
    require_wrk()
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        p.error(
            f"--backends: {', '.join(unknown) or 'none given'}; choose of {', '.join(BACKENDS)}"
        )
    print(
        f"CPU: {cpu_model()}; {args.records} records, d = {args.latent}, view {QUERY!r}, "
        f"{args.workers} worker(s), flat views (exact: recall@10 1.0 on each backend), wrk on "
        "the same cores"
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_records(work / "records.jsonl", args.records)
        make_model(work / "model", args.latent, REPO)
        for name in backends:
            with backend(name, work) as extra:
                root, took = build(work, name, *extra)
                r = serve(root, args.workers, args.seconds)
            r["build_s"] = took
            results[name] = r
            one, many = r["1_connection"], r["32_connections"]
            print(
                f"{name:>17}: build {took:6.1f} s; ready {r['ready_s']:.2f} s; 1 connection "
                f"{one['qps']:7.0f} q/s p50 {one['p50_ms']:6.2f} ms; 32 connections "
                f"{many['qps']:7.0f} q/s p50 {many['p50_ms']:6.2f} ms p99 "
                f"{many['p99_ms']:6.2f} ms; {one['non_2xx'] + many['non_2xx']} not 2xx"
            )
    if "faiss" in results:
        f = results["faiss"]["32_connections"]["qps"]
        for name in backends:
            if name != "faiss":
                m = results[name]["32_connections"]["qps"]
                print(f"{name} / faiss at 32 connections: {m / f:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
