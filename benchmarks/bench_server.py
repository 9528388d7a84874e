"""Search service benchmark on a flat view (100k records, d = 128 by default). Prints figures;
it is not a test (a shared machine is noisy: compare figures taken in one run).

    python benchmarks/bench_server.py [--records 100000] [--seconds 8] [--workers 1 2]
    python benchmarks/bench_server.py --repo /path/to/another/checkout

Prints, side by side in one run:
- the CPU, and the BLAS libraries loaded with the architecture each runs (threadpoolctl);
- raw exact search on the view's memory-mapped vectors: FAISS's scan one query at a time on
  one thread (the reference; the median of five 1-second rounds), exact search as the service
  runs it (indexer.search.exact) at batch sizes 1-64 on one thread, and the batched-product
  limit: numpy's product of the view with 64 queries at a time on every core, the most a
  server that answers every query exactly can reach here;
- `import torch` alone, in a fresh interpreter (the floor of any worker's start-up);
- the server (`hclip serve --workers N` for each N asked): time to ready (process start to
  the first 200 from /readyz), queries per second and p50/p99 with 1 and with 32 connections,
  every query distinct (nothing from the cache), and the latency of a cache hit. The load comes
  from wrk (Debian's, a C program, a Lua script drawing a fresh random query per request) on
  the same cores, so served figures are a floor.

`--repo` serves another checkout (any version of this project: only its command line and HTTP
API are used) for a before/after comparison; the raw figures always come from this checkout.
Run it once more under `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` where the machine sets
those (users' machines do not): the BLAS kernels chosen, and so the figures, can differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
QUERY = "image"
DIMS = {"image": 64, "audio": 64, "text": 64}  # `vector` features standing in for backbones
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def env_for(repo: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(repo), **extra}
    env.pop("HCLIP_REDIS_URL", None)
    return env


def write_records(path: Path, n: int, seed: int = 0) -> None:
    import orjson

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            cols = {k: rng.standard_normal((m, d)).astype(np.float32) for k, d in DIMS.items()}
            lines = []
            for i in range(m):
                rec: dict[str, Any] = {"id": f"r{start + i}", "payload": {"i": start + i}}
                rec.update({k: v[i] for k, v in cols.items()})
                lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"\n".join(lines) + b"\n")


def make_model(path: Path, latent: int, repo: Path) -> None:
    code = (
        "import sys, torch; from models.checkpoint import save_model; "
        "from models.config import ModelConfig; from models.model import MultimodalModel; "
        f"cfg = ModelConfig.from_dict({{'modalities': {{k: {{'kind': 'vector', 'dim': d}} "
        f"for k, d in {DIMS!r}.items()}}, 'head': 'hclip', 'latent_dim': {latent}}}); "
        "torch.manual_seed(0); save_model(MultimodalModel(cfg), sys.argv[1], overwrite=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=repo, env=env_for(repo), check=True)


def build(repo: Path, work: Path) -> Path:
    root = work / f"root-{repo.name}"
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(work / "model"),
           "--records", str(work / "records.jsonl"), "--root", str(root), "--quiet",
           "--views", QUERY]  # fmt: skip
    subprocess.run(cmd, cwd=repo, env=env_for(repo), check=True, stdout=subprocess.DEVNULL)
    return root


# --- raw kernels, in this process (and again in a child with the BLAS variables unset) -------


def view_vectors(root: Path) -> np.ndarray:
    sys.path.insert(0, str(REPO))
    from indexer.store import artifact

    vdir = artifact.current_version_dir(root)
    return np.load(vdir / "views" / f"{QUERY}.npy", mmap_mode="c")


def blas_libraries() -> list[str]:
    import threadpoolctl

    return [
        f"{i.get('prefix')} {i.get('version') or ''} {i.get('architecture') or ''}".strip()
        for i in threadpoolctl.threadpool_info()
        if i.get("user_api") == "blas"
    ]


def _rate(fn: Any, seconds: float) -> float:
    """Calls per second of fn() over at least `seconds` and three calls."""
    fn()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or done < 3:
        fn()
        done += 1
    return done / (time.perf_counter() - t0)


def raw_figures(root: Path, seconds: float) -> dict[str, Any]:
    """FAISS's scan one query at a time (five rounds), exact search as served at each batch
    size, one thread; and numpy's batched product on every core (the limit)."""
    import faiss
    import threadpoolctl
    import torch

    sys.path.insert(0, str(REPO))
    from indexer.search import exact

    xb = view_vectors(root)
    np.asarray(xb).sum()  # fault the pages in: every figure reads the same resident data
    rng = np.random.default_rng(9)
    queries = rng.standard_normal((256, xb.shape[1])).astype(np.float32)
    with threadpoolctl.threadpool_limits(1):
        torch.set_num_threads(1)
        faiss.omp_set_num_threads(1)
        rounds = []
        at = iter(range(10**12))  # a fresh query each call
        for _ in range(5):
            rounds.append(_rate(lambda: exact.search(queries[next(at) % 256][None], xb, 10), 1.0))
        served = {
            b: b * _rate(lambda b=b: exact.search(queries[:b], xb, 10), seconds)
            for b in (1, 2, 4, 8, 16, 32, 64)
        }
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    with threadpoolctl.threadpool_limits(cores):
        q64 = np.ascontiguousarray(queries[:64])

        def product() -> None:
            for start in range(0, xb.shape[0], 65536):  # blocks: the scores stay small
                s = q64 @ xb[start : start + 65536].T  # (64, rows)
                np.argpartition(s, -10, axis=1)

        limit = 64 * _rate(product, 2 * seconds)
    return {
        "single": {"qps": float(np.median(rounds)), "min": min(rounds), "max": max(rounds)},
        "served_kernels": served,
        "batched_limit": {"qps": limit, "cores": cores},
        "blas": blas_libraries(),
        "n": int(xb.shape[0]),
        "d": int(xb.shape[1]),
    }


def import_torch_s() -> float:
    """`import torch` alone in a fresh interpreter, the best of three."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    return min(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout)
        for _ in range(3)
    )  # fmt: skip


# --- the server -------------------------------------------------------------------------------

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


def require_wrk() -> None:
    """Stop at start where wrk is missing, not after minutes of building and warming up."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not on PATH: install it first (Debian, Ubuntu: apt install wrk)")


def wrk(
    url: str, connections: int, seconds: float, script: str, timeout_s: float = 2.0
) -> dict[str, Any]:
    """wrk's figures; a request unanswered within `timeout_s` counts as a timeout (wrk's own
    default is 2 s: a slow workload at 32 connections needs more)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
             f"--timeout={max(1, round(timeout_s))}s", "-s", f.name, url],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    timeouts = re.search(r"timeout (\d+)", out)
    if "50" not in pct:  # nothing was answered in time
        raise SystemExit(f"wrk: no request answered within {timeout_s:g} s:\n{out}")
    return {
        "qps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "non_2xx": int(bad.group(1)) if bad else 0,
        "timeouts": int(timeouts.group(1)) if timeouts else 0,
        # wrk's own CPU over the load, in cores: on one machine it shares them with the server
        "client_cores": cpu_s / max(1, round(seconds)),
    }


def cache_hit(url: str, seconds: float) -> dict[str, Any]:
    import httpx

    body = {"query": {QUERY: [0.25] * DIMS[QUERY]}, "k": 10}
    assert httpx.post(url + "/v1/search", json=body, timeout=30).json()["cached"] is False
    # Without Redis each worker has its own cache, and each new connection may land on either
    # worker: send the query until every worker has very likely cached it.
    cached = [httpx.post(url + "/v1/search", json=body, timeout=30).json()["cached"]
              for _ in range(20)]  # fmt: skip
    assert cached.count(True) >= 10, cached
    script = (
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{json.dumps(body)}'\n"
        'request = function() return wrk.format(nil, "/v1/search") end\n'
    )
    return wrk(url, 1, seconds, script)


def wait_ready(
    url: str, proc: subprocess.Popen, limit_s: float = 60.0, path: str = "/readyz"
) -> None:
    """Until `path` answers 200 (a peer's server: its own health route)."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit("the server never became ready")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not stopped within 30 s."""
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def served(repo: Path, root: Path, workers: int, seconds: float, port: int) -> dict[str, Any]:
    env = env_for(repo, HCLIP_ROOT=str(root), HCLIP_PORT=str(port),
                  HCLIP_CACHE_MAX_ITEMS="200000", HCLIP_CACHE_MAX_BYTES=str(4 << 30))  # fmt: skip
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    t0 = time.perf_counter()
    server = subprocess.Popen(
        cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        ready_s = time.perf_counter() - t0
        time.sleep(3.0)  # let every worker finish starting (older checkouts measured kernels)
        dim = DIMS[QUERY]
        # Warm-up, queries not reused: a lone query's latency on these VMs settles only after
        # a few hundred searches (the host keeps an idle vCPU asleep), so each load gets its own.
        wrk(url, 32, 1.0, WRK_SCRIPT % (99, dim, QUERY))
        wrk(url, 1, 3.0, WRK_SCRIPT % (98, dim, QUERY))
        return {
            "ready_s": ready_s,
            "1_connection": wrk(url, 1, seconds, WRK_SCRIPT % (1, dim, QUERY)),
            "32_connections": wrk(url, 32, seconds, WRK_SCRIPT % (2, dim, QUERY)),
            "cache_hit": cache_hit(url, seconds / 2),
        }
    finally:
        stop(server)


def cpu_model() -> str:
    """The CPU as the kernel names it, with its family and model: machines of one kind differ,
    and the name alone ("AMD EPYC") does not tell a Zen 3 from a Zen 5."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(.*)$", info, re.M)
        return found.group(1).strip() if found else "?"

    return f"{field('model name')} (family {field('cpu family')} model {field('model')})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--latent", type=int, default=128, help="d, the view's width")
    p.add_argument("--seconds", type=float, default=8.0, help="each served measurement")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--workers", type=int, nargs="+", default=sorted({1, cores}),
                   help="worker counts to serve with (default: 1 and one per core)")  # fmt: skip
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout to serve")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", type=Path, default=Path("bench-out/server.json"))
    args = p.parse_args()
    require_wrk()
    repo = args.repo.resolve()
    blas_env = {v: os.environ.get(v, "unset") for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    figures: dict[str, Any] = {"records": args.records, "cpu": cpu_model(), "repo": str(repo),
                               "blas_env": blas_env}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_records(work / "records.jsonl", args.records)
        make_model(work / "model", args.latent, repo)
        root = build(repo, work)
        mine = root if repo == REPO else build(REPO, work)
        figures["raw"] = raw_figures(mine, args.seconds / 16)
        figures["import_torch_s"] = import_torch_s()
        figures["served"] = {
            w: served(repo, root, w, args.seconds, args.port + i)
            for i, w in enumerate(args.workers)
        }
    raw = figures["raw"]
    single, limit = raw["single"]["qps"], raw["batched_limit"]["qps"]
    env_text = ", ".join(f"{k}={v}" for k, v in blas_env.items())
    print(f"CPU: {figures['cpu']}; {cores} cores; {env_text}")
    print(f"BLAS: {'; '.join(raw['blas'])}; checkout served: {repo}")
    print(
        f"raw FAISS scan, one query at a time, one thread: {single:.0f} queries/s "
        f"({1e3 / single:.2f} ms; median of 5 rounds, {raw['single']['min']:.0f}-"
        f"{raw['single']['max']:.0f}) on {raw['n']} x {raw['d']}"
    )
    print(
        "exact search as served, one thread, queries/s by batch size: "
        + ", ".join(f"{b}: {q:.0f}" for b, q in raw["served_kernels"].items())
        + " (faiss.knn: indexer/search/exact.py)"
    )
    print(f"batched-product limit (numpy, 64 queries, {cores} cores): {limit:.0f} queries/s")
    print(f"import torch alone: {figures['import_torch_s']:.2f} s")
    for w, f in figures["served"].items():
        one, many, hit = f["1_connection"], f["32_connections"], f["cache_hit"]
        print(f"served, {w} worker(s): ready {f['ready_s']:.2f} s after start")
        print(
            f"  1 connection:   {one['qps']:>6.0f} q/s  p50 {one['p50_ms']:.2f} ms  "
            f"p99 {one['p99_ms']:.2f} ms  (p50 - raw single {one['p50_ms'] - 1e3 / single:+.2f} ms)"
        )
        print(
            f"  32 connections: {many['qps']:>6.0f} q/s  p50 {many['p50_ms']:.2f} ms  "
            f"p99 {many['p99_ms']:.2f} ms  ({many['qps'] / single:.2f}x raw single-query, "
            f"{many['qps'] / limit:.2f} of the limit; {many['non_2xx']} not 2xx)"
        )
        print(f"  cache hit, 1 connection: p50 {hit['p50_ms']:.2f} ms, p99 {hit['p99_ms']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
