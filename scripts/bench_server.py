"""Search service benchmark on a flat view (100k records, d = 128 by default). Prints figures;
it is not a test (this machine is shared and noisy: compare figures taken in one run).

    python scripts/bench_server.py [--records 100000] [--seconds 8] [--workers 1 2]
    python scripts/bench_server.py --repo /path/to/another/checkout --workers 1

Prints, side by side in one run:
- the CPU, and the BLAS libraries loaded with the architecture each runs (threadpoolctl);
- raw exact search on the view's memory-mapped vectors, one thread: FAISS one query at a time
  (the reference for the targets: the median of five 1-second rounds), and every kernel at
  batch sizes 1-256 (FAISS's scan, its scan over cache-sized blocks, its BLAS path, torch,
  numpy, numpy's products with torch's top-k): the table the server's router measures for
  itself at start-up;
  the same table again in a fresh process with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset,
  as on users' machines (these machines set them);
- a search's own work on the event loop (checks, encoder, query factor), with warm caches and
  right after a scan of the view on the other core, which evicts it from the shared cache;
- the server (`hclip serve --workers N` for each N asked): queries per second and p50/p99 with
  1 and with 32 connections, every query distinct (nothing from the cache), and the latency
  of a cache hit. The load comes from wrk (Debian's, a C program, a Lua script drawing a fresh
  random query per request) on the same two cores, so served figures are a floor.

`--repo` serves another checkout (any version of this project: only its command line and HTTP
API are used) for a before/after comparison; the raw figures always come from this checkout.
"""

from __future__ import annotations

import argparse
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
    from indexer import artifact

    vdir = artifact.current_version_dir(root)
    return np.load(vdir / "views" / f"{QUERY}.npy", mmap_mode="c")


def kernel_table(root: Path, seconds_each: float) -> dict[str, Any]:
    """Queries per second of every kernel at every batch size, one thread, on the view."""
    import faiss
    import threadpoolctl
    import torch

    sys.path.insert(0, str(REPO))
    from indexer import flat

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    threadpoolctl.threadpool_limits(1)
    xb = view_vectors(root)
    np.asarray(xb).sum()  # fault the pages in: every kernel reads the same resident data
    rng = np.random.default_rng(0)
    kernels = {
        "faiss_scan": (flat.faiss_knn, flat.NEVER_BLAS),
        "faiss_blocked": (flat.faiss_blocked, flat.NEVER_BLAS),
        "faiss_blas": (flat.faiss_knn, 0),
        "torch": (flat.torch_blocked, None),
        "numpy": (flat.numpy_blocked, None),
        "numpy_topk": (flat.numpy_topk, None),
    }
    table: dict[str, dict[int, float]] = {k: {} for k in kernels}
    for b in BATCHES:
        xq = rng.standard_normal((b, xb.shape[1])).astype(np.float32)
        for name, (fn, threshold) in kernels.items():
            if threshold is not None:
                faiss.cvar.distance_compute_blas_threshold = threshold
            fn(xq, xb, 10)
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds_each or done < 3:
                fn(xq, xb, 10)
                done += 1
            table[name][b] = b * done / (time.perf_counter() - t0)
    libs = [
        f"{i.get('prefix')} {i.get('version') or ''} {i.get('architecture') or ''}".strip()
        for i in threadpoolctl.threadpool_info()
        if i.get("user_api") == "blas"
    ]
    return {"qps": table, "blas": libs, "n": int(xb.shape[0]), "d": int(xb.shape[1])}


def raw_single_query(root: Path, seconds: float, rounds: int = 5) -> dict[str, float]:
    """The targets' reference: FAISS's scan, one query at a time, one thread, on the view; the
    median of `rounds` rounds of `seconds` each (the kernel table's 0.2 s cells moved it by
    +-10% between runs on this shared machine), with the spread."""
    import faiss

    sys.path.insert(0, str(REPO))
    from indexer import flat

    faiss.omp_set_num_threads(1)
    faiss.cvar.distance_compute_blas_threshold = flat.NEVER_BLAS
    xb = view_vectors(root)
    np.asarray(xb).sum()
    rng = np.random.default_rng(9)
    queries = rng.standard_normal((256, xb.shape[1])).astype(np.float32)
    rates = []
    for _ in range(rounds):
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            flat.faiss_knn(queries[done % 256][None], xb, 10)
            done += 1
        rates.append(done / (time.perf_counter() - t0))
    return {"qps": float(np.median(rates)), "min": min(rates), "max": max(rates)}


def kernel_table_unset_env(root: Path, seconds_each: float) -> dict[str, Any]:
    env = env_for(REPO)
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(var, None)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[3]); import bench_server as b; "
        "from pathlib import Path; "
        "print(json.dumps(b.kernel_table(Path(sys.argv[1]), float(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), str(seconds_each), str(HERE)],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    table = json.loads(out.strip().splitlines()[-1])
    table["qps"] = {k: {int(b): v for b, v in t.items()} for k, t in table["qps"].items()}
    return dict(table)


def request_path_after_scans(root: Path, n: int = 200) -> dict[str, float]:
    """Microseconds of a search's own work on the event loop (the checks, the encoder, the
    query factor) with warm caches, and right after a scan of the view on another thread: the
    scan streams the view through the last-level cache both cores share, and what the request
    path needs is fetched from memory again."""
    import asyncio
    import threading

    sys.path.insert(0, str(REPO))
    from app.main import create_app
    from app.routes import search
    from app.schemas import SearchRequest
    from app.settings import Settings

    app = create_app(Settings(root=root, calibrate_kernels=False))
    rng = np.random.default_rng(5)
    bodies = [
        SearchRequest.model_validate(
            {"query": {QUERY: rng.uniform(-1, 1, DIMS[QUERY]).tolist()}, "k": 10}
        )
        for _ in range(n)
    ]

    async def measure() -> dict[str, float]:
        async with app.router.lifespan_context(app):
            state = app.state.hclip
            while state.versions.current is None:
                await asyncio.sleep(0.05)
            serving = state.versions.current
            view = serving.index.views[QUERY]
            xq = rng.standard_normal((1, view.dim)).astype(np.float32)

            def scan_elsewhere() -> None:
                t = threading.Thread(target=view.search, args=(xq, 10, "faiss"))
                t.start()
                t.join()

            out = {}
            for label, before in (("warm", None), ("after_scan", scan_elsewhere)):
                total = 0.0
                for body in bodies:
                    if before is not None:
                        before()
                    t0 = time.perf_counter()
                    checked = search._checked(state, serving, body)
                    await search._query_vector(state, serving, body, checked, {QUERY: ""})
                    total += time.perf_counter() - t0
                out[label] = total / n * 1e6
            return out

    return asyncio.run(measure())


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


def wrk(url: str, connections: int, seconds: float, script: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
             "-s", f.name, url],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "qps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "non_2xx": int(bad.group(1)) if bad else 0,
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


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit("the server never became ready")


def served(repo: Path, root: Path, workers: int, seconds: float, port: int) -> dict[str, Any]:
    env = env_for(repo, HCLIP_ROOT=str(root), HCLIP_PORT=str(port),
                  HCLIP_CACHE_MAX_ITEMS="200000")  # fmt: skip
    cmd = [sys.executable, "-m", "app.cli", "serve"]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    server = subprocess.Popen(
        cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        time.sleep(3.0)  # the kernel router measures itself on the FAISS thread after ready
        dim = DIMS[QUERY]
        wrk(url, 4, 1.0, WRK_SCRIPT % (99, dim, QUERY))  # warm-up, queries not reused
        return {
            "1_connection": wrk(url, 1, seconds, WRK_SCRIPT % (1, dim, QUERY)),
            "32_connections": wrk(url, 32, seconds, WRK_SCRIPT % (2, dim, QUERY)),
            "cache_hit": cache_hit(url, seconds / 2),
        }
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def cpu_model() -> str:
    """The CPU as the kernel names it, with its family and model: machines of one kind differ,
    and the name alone ("AMD EPYC") does not tell a Zen 3 from a Zen 5."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(.*)$", info, re.M)
        return found.group(1).strip() if found else "?"

    return f"{field('model name')} (family {field('cpu family')} model {field('model')})"


def print_table(title: str, t: dict[str, Any]) -> None:
    print(f"{title} ({t['n']} x {t['d']}; BLAS: {'; '.join(t['blas'])})")
    print(f"  {'batch':>5} " + " ".join(f"{k:>11}" for k in t["qps"]) + "   fastest")
    for b in BATCHES:
        row = {k: t["qps"][k][b] for k in t["qps"]}
        print(
            f"  {b:>5} " + " ".join(f"{v:>11.0f}" for v in row.values()) +
            f"   {max(row, key=lambda k: row[k])}"
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--latent", type=int, default=128, help="d, the view's width")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout to serve")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", type=Path, default=Path("bench-out/server.json"))
    args = p.parse_args()
    repo = args.repo.resolve()
    figures: dict[str, Any] = {"records": args.records, "cpu": cpu_model(), "repo": str(repo)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_records(work / "records.jsonl", args.records)
        make_model(work / "model", args.latent, repo)
        root = build(repo, work)
        mine = root if repo == REPO else build(REPO, work)
        figures["kernels"] = kernel_table(mine, args.seconds / 40)
        figures["kernels_blas_env_unset"] = kernel_table_unset_env(mine, args.seconds / 40)
        figures["request_path_us"] = request_path_after_scans(mine)
        figures["raw_single_query"] = raw_single_query(mine, args.seconds / 8)
        figures["served"] = {
            w: served(repo, root, w, args.seconds, args.port + i)
            for i, w in enumerate(args.workers)
        }
    ref = figures["raw_single_query"]
    raw = ref["qps"]
    print(f"CPU: {figures['cpu']}; checkout served: {repo}")
    print(
        f"raw FAISS, one query at a time, one thread: {raw:.0f} queries/s ({1e3 / raw:.2f} ms; "
        f"median of 5 rounds of {args.seconds / 8:g} s, {ref['min']:.0f}-{ref['max']:.0f})"
    )
    print_table("kernels, queries/s, one thread", figures["kernels"])
    print_table(
        "kernels with OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset", figures["kernels_blas_env_unset"]
    )
    rp = figures["request_path_us"]
    print(
        f"a search's own work on the event loop (checks, encoder, query factor): "
        f"{rp['warm']:.0f} us with warm caches, {rp['after_scan']:.0f} us right after a scan "
        f"of the view on the other core ({rp['after_scan'] / rp['warm']:.1f}x)"
    )
    for w, f in figures["served"].items():
        one, many, hit = f["1_connection"], f["32_connections"], f["cache_hit"]
        print(f"served, {w} worker(s):")
        print(
            f"  1 connection:   {one['qps']:>6.0f} q/s  p50 {one['p50_ms']:.2f} ms  "
            f"p99 {one['p99_ms']:.2f} ms  (p50 - raw single {one['p50_ms'] - 1e3 / raw:+.2f} ms)"
        )
        print(
            f"  32 connections: {many['qps']:>6.0f} q/s  p50 {many['p50_ms']:.2f} ms  "
            f"p99 {many['p99_ms']:.2f} ms  ({many['qps'] / raw:.2f}x raw single-query; "
            f"{many['non_2xx']} not 2xx)"
        )
        print(f"  cache hit, 1 connection: p50 {hit['p50_ms']:.2f} ms, p99 {hit['p99_ms']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
