"""Serving at scale: build an index of N records, serve it, and print what serving costs.
Prints figures; it is not a test (this machine is shared and noisy).

    python benchmarks/bench_scale.py --records 1000000 [--views all|one] [--searches 10000]
    python benchmarks/bench_scale.py --records 1000000 --repo /path/to/another/checkout

Records have three 16-d `vector` modalities (a, b, c) and a small payload; the model is an
untrained H-CLIP with d = 64. For each run it prints: the build's time and peak RSS, the
server's time from process start to ready (/readyz 200) and how long loading the version took,
its RSS after start, after `--searches` searches (32 concurrent, every query distinct, sent by
app.client through /v1/search), and at its largest while a new version (one upserted record, so
every file is new) is swapped in under search load; and search p50/p99 with one client. RSS is
split into anonymous memory (the process's own) and file-backed pages (memory-mapped index
files, which the page cache holds and any process can share). `--repo` runs another checkout's
code with the same commands (the previous implementation, for a before/after comparison); only
the command line and the HTTP API are used, so any version of this project runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # app.client, when the package is not installed
DIMS = {"a": 16, "b": 16, "c": 16}
LATENT = 64


def write_records(path: Path, n: int, seed: int = 0, prefix: str = "r") -> None:
    import orjson

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            cols = {k: rng.standard_normal((m, d)).astype(np.float32) for k, d in DIMS.items()}
            cats = rng.integers(0, 100, m)
            lines = []
            for i in range(m):
                rec: dict[str, Any] = {
                    "id": f"{prefix}{start + i}",
                    "payload": {"i": start + i, "category": f"c{cats[i]}"},
                }
                for k, v in cols.items():
                    rec[k] = v[i]
                lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"\n".join(lines) + b"\n")


def make_model(path: Path, repo: Path) -> None:
    code = (
        "import sys, torch; from models.checkpoint import save_model; "
        "from models.config import ModelConfig; from models.model import MultimodalModel; "
        f"cfg = ModelConfig.from_dict({{'modalities': {{k: {{'kind': 'vector', 'dim': d}} "
        f"for k, d in {DIMS!r}.items()}}, 'head': 'hclip', 'latent_dim': {LATENT}}}); "
        "torch.manual_seed(0); save_model(MultimodalModel(cfg), sys.argv[1], overwrite=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=repo, check=True, env=_env(repo))


def _env(repo: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(repo), **extra}
    env.pop("HCLIP_REDIS_URL", None)
    return env


def run_job(repo: Path, *args: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "app.cli", "index", *args, "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=_env(repo), stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed with status {status}")
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mb": usage.ru_maxrss / 1024}


def rss(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def fmt(r: dict[str, float]) -> str:
    return f"{r['VmRSS']:.0f} MB (anon {r['RssAnon']:.0f}, file {r['RssFile']:.0f})"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.005)
    raise SystemExit("the server never became ready")


def queries(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIMS["a"])).astype(np.float32)


async def search_load(url: str, xq: np.ndarray, concurrency: int) -> list[float]:
    """Searches through the package's own client (app.client), `concurrency` at a time; no
    retries, so that a failed search stops the benchmark instead of hiding in its latency."""
    from app.client import AsyncClient, HclipError

    latencies: list[float] = []
    it = iter(range(len(xq)))

    async def worker(client: AsyncClient) -> None:
        for i in it:
            t = time.perf_counter()
            try:
                await client.search({"a": xq[i]}, k=10)
            except HclipError as exc:
                raise SystemExit(f"search failed: {exc}") from None
            latencies.append(time.perf_counter() - t)

    async with AsyncClient(url, timeout=600, retries=0) as client:
        await client.info()  # once, before the workers start
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return latencies


def current_version(url: str) -> str:
    import httpx

    return str(httpx.get(url + "/readyz", timeout=5).json()["index_version"])


def swap_under_load(url: str, pid: int, repo: Path, work: Path, seed: int) -> dict[str, Any]:
    """Publish a new version (an update upserting one record) while 4 clients search; sample
    the server's RSS every 50 ms until it serves the new version."""
    before = current_version(url)
    write_records(work / "upsert.jsonl", 1, seed=seed, prefix="new")
    job = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "index", "update", "--root", str(work / "root"),
         "--upsert", str(work / "upsert.jsonl"), "--quiet"],
        cwd=repo, env=_env(repo), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    peak: dict[str, float] = {"VmRSS": 0.0}
    stop = False

    async def load() -> None:
        while not stop:
            await search_load(url, queries(8, seed + int(time.time() * 1000) % 1000), 4)

    async def watch() -> float:
        nonlocal stop, peak
        t0 = time.perf_counter()
        swap_started = None
        while True:
            r = rss(pid)
            if r["VmRSS"] > peak["VmRSS"]:
                peak = r
            if job.poll() is not None and swap_started is None:
                if job.returncode != 0:
                    raise SystemExit("the update failed")
                swap_started = time.perf_counter()
            if swap_started is not None and current_version(url) != before:
                stop = True
                return time.perf_counter() - swap_started
            await asyncio.sleep(0.05)
            if time.perf_counter() - t0 > 3600:
                raise SystemExit("no swap within an hour")

    async def main() -> float:
        task = asyncio.create_task(load())
        took = await watch()
        await task
        return took

    took = asyncio.run(main())
    return {"peak": peak, "swap_after_publish_s": took, "after": rss(pid)}


def serve_and_measure(repo: Path, work: Path, searches: int, port: int) -> dict[str, Any]:
    env = _env(
        repo,
        HCLIP_ROOT=str(work / "root"),
        HCLIP_PORT=str(port),
        HCLIP_POLL_INTERVAL_S="0.2",
        HCLIP_CACHE_MAX_ITEMS="10",
        HCLIP_CACHE_MAX_BYTES="0",
    )
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_ready(url, server)
        ready = time.perf_counter() - t0  # from spawning the process
        out: dict[str, Any] = {"ready_s": ready, "after_start": rss(server.pid)}
        one = asyncio.run(search_load(url, queries(min(200, searches), 7), 1))
        out["p50_ms"] = float(np.percentile(one, 50) * 1000)
        out["p99_ms"] = float(np.percentile(one, 99) * 1000)
        t1 = time.perf_counter()
        asyncio.run(search_load(url, queries(searches, 11), 32))
        out["searches_per_s"] = searches / (time.perf_counter() - t1)
        out["after_searches"] = rss(server.pid)
        out["swap"] = swap_under_load(url, server.pid, repo, work, seed=5)
    finally:
        server.terminate()
        try:
            _, err = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    out["load_log"] = [line for line in err.splitlines() if "serving version" in line][:2]
    return out


def floor_rss(repo: Path, model: Path) -> dict[str, float]:
    """A process that imports what the server imports and loads the model: the part of the
    server's RSS that no index is responsible for."""
    code = (
        "import sys, app.main, torch; from models.checkpoint import load_model; "
        "m = load_model(sys.argv[1]); print(open('/proc/self/status').read())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        cwd=repo, env=_env(repo), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--views", choices=["all", "one"], default="all", help="one: view 'a' only")
    p.add_argument("--searches", type=int, default=10_000)
    p.add_argument("--repo", type=Path, default=HERE.parent, help="the checkout to run")
    p.add_argument("--work", type=Path, help="keep the data here (default: a temporary dir)")
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--out", type=Path, default=Path("bench-out/scale.json"))
    args = p.parse_args()
    repo = args.repo.resolve()
    tmp = None
    if args.work is None:
        tmp = tempfile.mkdtemp(prefix="hclip-scale-", dir=os.environ.get("TMPDIR"))
        work = Path(tmp)
    else:
        work = args.work
        work.mkdir(parents=True, exist_ok=True)
    try:
        records = work / f"records-{args.records}.jsonl"
        if not records.exists():
            t = time.perf_counter()
            write_records(records, args.records)
            print(f"wrote {args.records} records in {time.perf_counter() - t:.0f} s", flush=True)
        make_model(work / "model", repo)
        shutil.rmtree(work / "root", ignore_errors=True)
        views = ["--views", "a"] if args.views == "one" else []
        build = run_job(
            repo, "build", "--model", str(work / "model"), "--records", str(records),
            "--root", str(work / "root"), *views,
        )  # fmt: skip
        disk = sum(f.stat().st_size for f in (work / "root").rglob("*") if f.is_file())
        print(
            f"built {args.records} records ({args.views} views) in {build['wall_s']:.0f} s, "
            f"peak RSS {build['peak_rss_mb']:.0f} MB, {disk / 1e9:.2f} GB on disk",
            flush=True,
        )
        floor = floor_rss(repo, work / "model")
        served = serve_and_measure(repo, work, args.searches, args.port)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    s = served["swap"]
    print(f"checkout: {repo}")
    print(f"records {args.records}, views {args.views}, d = {LATENT}")
    print(f"imports + model alone (no index): {fmt(floor)}")
    print(f"time to ready (process start to /readyz 200): {served['ready_s']:.2f} s")
    for line in served["load_log"]:
        print(f"  log: {line.split(': ', 1)[-1]}")
    print(f"RSS after start:             {fmt(served['after_start'])}")
    print(
        f"RSS after {args.searches} searches:  {fmt(served['after_searches'])}  "
        f"({served['searches_per_s']:.0f} searches/s, 32 clients)"
    )
    print(
        f"RSS during a swap (largest): {fmt(s['peak'])}; new version served "
        f"{s['swap_after_publish_s']:.2f} s after the update published"
    )
    print(f"RSS after the swap:          {fmt(s['after'])}")
    print(f"search, 1 client: p50 {served['p50_ms']:.1f} ms, p99 {served['p99_ms']:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "records": args.records,
        "views": args.views,
        "repo": str(repo),
        "build": build,
        "disk_bytes": disk,
        "floor": floor,
        **{k: v for k, v in served.items() if k != "load_log"},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
