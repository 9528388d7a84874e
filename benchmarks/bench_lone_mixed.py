"""Lone raw queries of every modality to a server that serves them all, and a change's effect on
them: two checkouts' servers side by side, queries alternating between them. Prints figures; it
is not a test (a shared machine is noisy).

    python benchmarks/bench_lone_mixed.py --work W                       # this checkout
    python benchmarks/bench_lone_mixed.py --work W --before ../before    # before -> after
    python benchmarks/bench_lone_mixed.py --work W --before ../before --workers 1 --load 30
    python benchmarks/bench_lone_mixed.py --work W --before B --workers 1 --load 30 --load-first

The towers, records and model are bench_tower_serving.py's (ViT-B/16, wav2vec 2.0 base, MiniLM
under an untrained H-CLIP model; `--work` keeps them). Each server is `hclip serve --workers
CORES` with caches off under --runtime; every tower first answers lone queries in every worker
(bench_tower_serving.every_tower_answers), as on a server whose clients send every modality.
Then, modality by modality, --pairs lone queries (a connection each, IDLE_S apart) go to one
server and then the other, the order swapped every pair: each side's median latency at the
client, and the median of the pairs' differences (after - before) with its quartiles. A lone
query is what a user's first query after a quiet moment meets: what one tower's calls leave in
a worker must not slow another's (app/services/threads.py). With --load S, each server then
takes text and image queries at once, 16 connections of each for S seconds (wrk), one server
after the other: each modality's q/s and p50 while the other's calls share the cores; with
--load-first, before the lone queries, which then meet workers whose calls have overlapped (with
fewer workers than cores, such calls each run on a team of OpenMP threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (env_for, wait_ready, stop, cpu_model)
from bench_tower_serving import (  # noqa: E402
    POOL,
    QUERY_OF,
    WRK_POOL,
    every_tower_answers,
    lone_query,
    query_pool,
    towers_and_index,
)

from models.machine import usable_cores  # noqa: E402

IDLE_S = 0.05  # between queries: each meets the server idle, its OpenMP threads asleep


def start(code: Path, root: Path, runtime: str, port: int, workers: int) -> subprocess.Popen[bytes]:
    env = bench_server.env_for(
        code, HCLIP_ROOT=str(root), HCLIP_PORT=str(port), HCLIP_CACHE_MAX_BYTES="0",
        HCLIP_ENCODER_RUNTIME=runtime, HCLIP_REQUEST_TIMEOUT_S="120",
    )  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)  # the service sizes its own pools from cores and workers
    env.pop("HCLIP_TORCH_THREADS", None)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    server = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    bench_server.wait_ready(f"http://127.0.0.1:{port}", server, limit_s=1800.0)
    return server


def mixed_load(port: int, files: dict[str, Path], seconds: float) -> dict[str, dict[str, float]]:
    """Text and image queries at once, 16 connections each: each modality's q/s and p50."""
    url = f"http://127.0.0.1:{port}"
    script = {kind: WRK_POOL % (path, 0, "/v1/search") for kind, path in files.items()}
    bench_server.wrk(url, 4, 5, script["image"], 60.0)  # every worker's image batches warm
    got: dict[str, dict[str, float]] = {}

    def load(kind: str) -> None:
        got[kind] = bench_server.wrk(url, 16, seconds, script[kind], 60.0)

    loads = [threading.Thread(target=load, args=(kind,)) for kind in files]
    for t in loads:
        t.start()
    for t in loads:
        t.join()
    return {kind: {"qps": got[kind]["qps"], "p50_ms": got[kind]["p50_ms"]} for kind in files}


def loads(
    servers: dict[str, tuple[subprocess.Popen[bytes], int]],
    files: dict[str, Path],
    seconds: float,
    workers: int,
) -> list[dict[str, object]]:
    """mixed_load on each server in turn (none where `seconds` is 0): a row each, printed."""
    rows: list[dict[str, object]] = []
    for side, (_, port) in servers.items() if seconds else ():
        mixed = mixed_load(port, files, seconds)
        rows.append({"load": side, "workers": workers, "seconds": seconds, **mixed})
        print(f"{side}: text and images at once, 16 connections each, {seconds:g} s: "
              + ", ".join(f"{kind} {m['qps']:.1f} q/s, p50 {m['p50_ms']:.1f} ms"
                          for kind, m in mixed.items()), flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, help="keep the towers, records and index here")
    p.add_argument("--records", type=int, default=32, help="records in the index")
    p.add_argument("--clip-seconds", type=float, default=5.0, help="audio clips' length")
    p.add_argument("--runtime", default="torch", help="HCLIP_ENCODER_RUNTIME of both servers")
    p.add_argument("--modalities", default="image,text,audio", help="those measured")
    p.add_argument("--pairs", type=int, default=40, help="lone queries per modality and server")
    p.add_argument(
        "--before", type=Path, help="a checkout of earlier code (git worktree add DIR REV)"
    )
    p.add_argument("--workers", type=int, help="workers of each server (default: one per core)")
    p.add_argument(
        "--load", type=float, default=0.0, help="then text and image loads at once, this long"
    )
    p.add_argument(
        "--load-first",
        action="store_true",
        help="run the loads before the lone queries: these then show what calls that overlapped "
        "under load leave in a worker",
    )
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    bench_server.require_wrk()
    if args.pairs < 4:
        p.error(f"--pairs: {args.pairs} is too few for a median and its quartiles (4 at least)")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: {args.out.parent} is not a folder")
    if args.load_first and not args.load:
        p.error("--load-first: give --load S too (the loads' length)")
    unknown = set(args.modalities.split(",")) - set(QUERY_OF)
    if unknown:
        known = ", ".join(QUERY_OF)
        p.error(f"--modalities: {', '.join(sorted(unknown))} unknown (known: {known})")
    work = args.work or Path(tempfile.mkdtemp(prefix="hclip-lone-mixed-"))
    cores = usable_cores()
    _, root = towers_and_index(work, args.records, args.clip_seconds)
    sides = {"after": REPO} if args.before is None else {"before": args.before, "after": REPO}
    bodies = {
        kind: [json.dumps({"query": {name: v}, "k": 10})
               for v in query_pool(kind, POOL[kind], args.clip_seconds)]
        for kind, name in QUERY_OF.items()
    }  # fmt: skip
    files = {}
    for kind in ("text", "image"):
        files[kind] = work / f"bodies-mixed-{kind}.jsonl"
        files[kind].write_text("".join(b + "\n" for b in bodies[kind]))
    warm = [b[0] for b in bodies.values()]
    workers = args.workers or cores
    print(f"{bench_server.cpu_model()}, {cores} cores; workers = {workers}; {args.runtime}")
    rows: list[dict[str, object]] = []
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for i, (side, code) in enumerate(sides.items()):
            port = args.port + i
            servers[side] = (start(code, root, args.runtime, port, workers), port)
            every_tower_answers(f"http://127.0.0.1:{port}", warm, workers)
        if args.load_first:
            rows += loads(servers, files, args.load, workers)
        for kind in args.modalities.split(","):
            took: dict[str, list[float]] = {side: [] for side in servers}
            order = list(servers)
            for i in range(args.pairs):
                for side in order if i % 2 == 0 else order[::-1]:
                    time.sleep(IDLE_S)
                    url = f"http://127.0.0.1:{servers[side][1]}"
                    took[side].append(lone_query(url, bodies[kind][i % len(bodies[kind])]))
            row: dict[str, object] = {"query": kind, "runtime": args.runtime, "pairs": args.pairs}
            row.update({f"{side}_p50_ms": statistics.median(t) for side, t in took.items()})
            line = f"{kind:6} " + ", ".join(
                f"{side} {statistics.median(t):.1f} ms" for side, t in took.items()
            )
            if "before" in took:
                diff = [a - b for a, b in zip(took["after"], took["before"], strict=True)]
                q = statistics.quantiles(diff, n=4)
                row["after_minus_before_ms"] = statistics.median(diff)
                row["quartiles_ms"] = [q[0], q[2]]
                line += (
                    f"; after - before {statistics.median(diff):+.1f} ms "
                    f"(quartiles {q[0]:+.1f} and {q[2]:+.1f}), {args.pairs} pairs"
                )
            rows.append(row)
            print(line, flush=True)
        if not args.load_first:
            rows += loads(servers, files, args.load, workers)
    finally:
        for server, _ in servers.values():
            bench_server.stop(server)
    if args.out:
        figures = {"cpu": bench_server.cpu_model(), "cores": cores, "rows": rows}
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
