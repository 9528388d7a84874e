"""The service behind two HTTP servers in turn: uvicorn, as `hclip serve` runs it, and Granian (a
Rust HTTP server with an ASGI interface). Prints figures; it is not a test (a shared machine is
noisy).

    pip install granian
    python benchmarks/bench_http_front.py --work W --runtimes onnx-int8,onnx --rounds 2

`W` is bench_tower_serving.py's work directory after a text run (its index root and its
text queries, `bodies-text.jsonl`).

The question it answers: does a compiled HTTP server take enough of the event loops' CPU a
query off the service to matter beside a cheap tower (bench_tower_serving.py's `onnx-int8`
text, whose 1.2 ms a query leaves the loops' 0.3 ms a visible share)? Both servers run the
same app (`app.main:create_app`), workers = cores, with the environment `hclip serve` gives its
workers (settings, OpenMP and tokenizer settings, a workers directory for /readyz, a metrics
directory), caches off, on W's index and raw text queries (every query its own sentence).
Uvicorn is `hclip serve --workers CORES` itself (httptools, uvloop); Granian is `granian
--interface asgi --factory --workers CORES --http 1` with its defaults otherwise (its loop:
uvloop where installed). In each round each runtime is served by uvicorn then Granian: a warm
load, a 32-connection load (q/s; the server's CPU a query answered, its workers' main threads
apart as `loops`), then a 1-connection load (p50).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (wrk, wait_ready, stop, cpu_model)
from bench_tower_serving import WRK_POOL, cpu_by_role, server_pids, wait_idle  # noqa: E402

from app.cli import SERVING_ENVIRONMENT  # noqa: E402
from models.machine import usable_cores  # noqa: E402

FRONTS = ("uvicorn", "granian")


def command(front: str, workers: int, port: int) -> list[str]:
    if front == "uvicorn":
        return [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    granian = shutil.which("granian") or str(Path(sys.executable).with_name("granian"))
    return [granian, "--interface", "asgi", "--factory", "--workers", str(workers),
            "--host", "127.0.0.1", "--port", str(port), "--http", "1",
            "--log-level", "warning", "app.main:create_app"]  # fmt: skip


def served(front: str, root: Path, runtime: str, bodies: Path, seconds: float, port: int,
           turn: int) -> dict[str, Any]:  # fmt: skip
    workers = usable_cores()
    scratch = Path(tempfile.mkdtemp(prefix="hclip-front-"))
    env = bench_server.env_for(
        REPO, HCLIP_ROOT=str(root), HCLIP_PORT=str(port), HCLIP_CACHE_MAX_BYTES="0",
        HCLIP_ENCODER_RUNTIME=runtime, HCLIP_MAX_PENDING="4096", HCLIP_WORKERS=str(workers),
        # what `hclip serve` gives its workers (app.cli, app.server.serve): the serving
        # settings where the environment does not have its own
        **{k: os.environ.get(k, v) for k, v in SERVING_ENVIRONMENT.items()},
        HCLIP_WORKERS_DIR=str(scratch / "workers"),
        PROMETHEUS_MULTIPROC_DIR=str(scratch / "metrics"),
    )  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)
    env.pop("HCLIP_TORCH_THREADS", None)
    for d in ("workers", "metrics"):
        (scratch / d).mkdir()
    server = subprocess.Popen(
        command(front, workers, port), cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    n = len(bodies.read_text().splitlines())
    try:
        bench_server.wait_ready(url, server, limit_s=600.0)
        bench_server.wrk(url, 32, max(4.0, seconds / 3), WRK_POOL % (bodies, n // 2, "/v1/search"))
        pids = server_pids(server.pid)
        wait_idle(pids)
        before = cpu_by_role(server.pid, pids)
        start = (turn * 997) % n  # each load its own sentences
        load = bench_server.wrk(url, 32, seconds, WRK_POOL % (bodies, start, "/v1/search"))
        after = cpu_by_role(server.pid, pids)
        wait_idle(pids)
        one = bench_server.wrk(url, 1, seconds / 2, WRK_POOL % (bodies, n // 3, "/v1/search"))
        answered = max(1, load["requests"])
        return {
            "qps": load["qps"],
            "p50_ms": one["p50_ms"],
            "loops_ms": 1e3 * (after["loop"] - before["loop"]) / answered,
            "server_ms": 1e3 * sum(after[k] - before[k] for k in after) / answered,
        }
    finally:
        bench_server.stop(server)
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="bench_tower_serving.py's --work")
    p.add_argument("--runtimes", default="onnx-int8", help="HCLIP_ENCODER_RUNTIME values")
    p.add_argument("--seconds", type=float, default=10.0, help="each 32-connection load")
    p.add_argument("--rounds", type=int, default=2, help="pairs of servings per runtime")
    p.add_argument("--port", type=int, default=8751)
    args = p.parse_args()
    bench_server.require_wrk()
    bodies, root = args.work / "bodies-text.jsonl", args.work / "root"
    if not bodies.is_file() or not root.is_dir():
        raise SystemExit(f"{args.work}: no bodies-text.jsonl or root (see the docstring)")
    if not (shutil.which("granian") or Path(sys.executable).with_name("granian").exists()):
        raise SystemExit("granian is not installed: pip install granian")
    print(f"{bench_server.cpu_model()}, {usable_cores()} workers, text queries")
    print(f"{'runtime':10} {'front':8} {'q/s':>8} {'loops':>8} {'server':>8} {'p50 1c':>8}"
          "   (CPU: ms a query answered at 32 connections)")  # fmt: skip
    turn = 0
    for r in range(args.rounds):
        for runtime in args.runtimes.split(","):
            got = {}
            for front in FRONTS:
                turn += 1
                got[front] = g = served(front, root, runtime, bodies, args.seconds, args.port, turn)
                print(f"{runtime:10} {front:8} {g['qps']:8.1f} {g['loops_ms']:8.3f} "
                      f"{g['server_ms']:8.3f} {g['p50_ms']:8.2f}", flush=True)  # fmt: skip
            ratio = got["granian"]["qps"] / got["uvicorn"]["qps"]
            print(f"{runtime:10} round {r + 1}: granian / uvicorn q/s {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
