"""What the field's HTTP stack alone costs the event loop per request, beside which the service's
own share is read. Prints figures; it is not a test (a shared machine is noisy).

    python benchmarks/bench_http_floor.py --bodies W/bodies-text.jsonl
    python benchmarks/bench_http_floor.py --bodies W/bodies-text.jsonl --wait-ms 0

`W` is bench_tower_serving.py's work directory (its text queries). Served by uvicorn as `hclip
serve` runs it (httptools, uvloop, workers = cores, no access log), three apps in turn: a
Starlette route, a FastAPI route, and the FastAPI route declared as the service declares its
search routes (`plain`: app.api.http.PlainRoute on the app's own router), each reading the
body, parsing it (orjson), waiting --wait-ms as a tower's encode would (so that requests arrive
at a served rate, not at the floor's own, where uvloop batches more events a wake-up) and
answering canned bytes of a real response's size (10 results). wrk sends the queries at 32
connections; the workers' main threads' CPU (utime + stime from /proc) over the requests
answered is the floor, the figure bench_tower_serving.py prints as `loop` for the service.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (wrk, cpu_model)
from bench_tower_serving import WRK_POOL, cpu_by_role, server_pids, wait_idle  # noqa: E402

from models.machine import usable_cores  # noqa: E402

ANSWER = orjson.dumps(
    {
        "cached": False,
        "index_version": "20261205T165830772778Z-d36fae",
        "view": "caption",
        "results": [
            {"id": f"r{i}", "score": 0.5 - i / 100, "payload": {"text": "a caption", "i": i}}
            for i in range(10)
        ],
    }
)


def make_app() -> Any:
    """The app a worker serves: FastAPI when FLOOR_APP=fastapi, else Starlette (the routes'
    annotations are resolved in this module's globals)."""
    wait_s = float(os.environ["FLOOR_WAIT_MS"]) / 1e3

    async def search(request: Request) -> Response:
        orjson.loads(await request.body())
        if wait_s:
            await asyncio.sleep(wait_s)
        return Response(ANSWER, media_type="application/json")

    async def ready(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    if os.environ["FLOOR_APP"] in ("fastapi", "plain"):
        from fastapi import FastAPI

        from app.api.http import PlainRoute

        app = FastAPI()
        if os.environ["FLOOR_APP"] == "plain":  # as the service's search routes are served
            app.router.add_api_route(
                "/v1/search", search, methods=["POST"], route_class_override=PlainRoute
            )
        else:
            app.post("/v1/search")(search)
        app.get("/readyz")(ready)
        return app
    from starlette.applications import Starlette
    from starlette.routing import Route

    routes = [Route("/v1/search", search, methods=["POST"]), Route("/readyz", ready)]
    return Starlette(routes=routes)


def floor(kind: str, bodies: Path, wait_ms: float, seconds: float, port: int) -> dict[str, Any]:
    env = {**os.environ, "FLOOR_APP": kind, "FLOOR_WAIT_MS": str(wait_ms)}
    cmd = [sys.executable, "-m", "uvicorn", "bench_http_floor:make_app", "--factory",
           "--workers", str(usable_cores()), "--port", str(port), "--no-access-log",
           "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=HERE, env=env)
    url = f"http://127.0.0.1:{port}"
    n = len(bodies.read_text().splitlines())
    try:
        bench_server.wait_ready(url, server)
        bench_server.wrk(url, 32, 3, WRK_POOL % (bodies, 0, "/v1/search"))  # warm
        pids = server_pids(server.pid)
        wait_idle(pids)
        before = cpu_by_role(server.pid, pids)
        load = bench_server.wrk(url, 32, seconds, WRK_POOL % (bodies, n // 3, "/v1/search"))
        after = cpu_by_role(server.pid, pids)
        loop_ms = 1e3 * (after["loop"] - before["loop"]) / max(1, load["requests"])
        return {"qps": load["qps"], "loop_cpu_ms_per_request": loop_ms}
    finally:
        bench_server.stop(server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bodies", type=Path, required=True, help="one JSON query a line")
    p.add_argument("--wait-ms", type=float, default=8.0, help="each request's wait")
    p.add_argument("--seconds", type=float, default=10.0, help="each load's length")
    p.add_argument("--rounds", type=int, default=2, help="loads per app, in turn")
    p.add_argument("--port", type=int, default=8741)
    args = p.parse_args()
    bench_server.require_wrk()
    print(f"{bench_server.cpu_model()}, {usable_cores()} workers, wait {args.wait_ms:g} ms")
    for _ in range(args.rounds):
        for kind in ("starlette", "fastapi", "plain"):
            got = floor(kind, args.bodies, args.wait_ms, args.seconds, args.port)
            print(f"{kind:10} {got['qps']:8.0f} q/s at 32 connections, event loops' CPU "
                  f"{got['loop_cpu_ms_per_request']:.3f} ms a request", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
