"""Compact against full versions of the same records (docs/guide.md, "Compact versions"). Prints
figures; it is not a test. Do not run it at full size on a shared machine.

    python benchmarks/bench_compact.py [--records 1000000] [--dim 128] [--queries 200]
                                       [--seconds 8] [--workers 2] [--work DIR]
                                       [--compact-spec SPEC ...] [--build-only]
                                       [--before DIR]

With --work, records and versions already there are kept (a build interrupted leaves no root):
build once (--build-only, on a busy machine if need be), then serve and measure on a quiet one.
Each --compact-spec (default `sq8:rerank=10`, the --compact default; `auto:recall=0.95` runs the
tuner) is one more compact version of the same records, served in turn with the full one.

N records of three `vector` modalities (d-wide features, an untrained d-wide H-CLIP model: its
embeddings are what a version stores; records drawn around 1,000 topics so that neighbours
exist) are built twice with `hclip index build`: a full flat version and a `--compact` one.
Printed, side by side:

- bytes on disk of each version (a hard link counted once), of its vectors alone (embeddings and
  views), and compact over full (the target: 0.40 or less);
- per view, through the API of each version served in turn (`hclip serve`), on held-out
  queries (records not indexed, their embeddings sent as `embeddings`): recall@10 against exact
  float32 search over the full version's views (faiss.knn), and the largest relative error of
  a returned score against the float32 exact score of the same record (target: 1e-2);
- served queries/s and p50 at 32 connections (wrk, every query distinct) on a product view (codes
  in the compact version) and on an all-but-one view (float16 there), full and compact.
"""

from __future__ import annotations

import argparse
import json
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
sys.path.insert(0, str(REPO))

from benchmarks.bench_server import env_for, require_wrk, stop, wait_ready, wrk  # noqa: E402

NAMES = ("image", "audio", "text")
TOPICS = 1000
K = 10
WRK_TIMEOUT_S = 60.0  # a 1M-record scan batch at 32 connections takes seconds on 2 cores
LOADS = ("image", "audio+text")  # a product view and an all-but-one view


def write_records(path: Path, n: int, dim: int, seed: int, prefix: str = "r") -> None:
    import orjson

    rng = np.random.default_rng(seed)
    centres = {m: np.random.default_rng(100 + i).standard_normal((TOPICS, dim))
               for i, m in enumerate(NAMES)}  # fmt: skip
    with open(path, "wb") as f:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            topic = rng.integers(0, TOPICS, m)
            cols = {k: (c[topic] + 0.5 * rng.standard_normal((m, dim))).astype(np.float32)
                    for k, c in centres.items()}  # fmt: skip
            lines = []
            for i in range(m):
                rec: dict[str, Any] = {
                    "id": f"{prefix}{start + i}",
                    "payload": {"t": int(topic[i])},
                }
                rec.update({k: v[i] for k, v in cols.items()})
                lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"\n".join(lines) + b"\n")


def make_model(path: Path, dim: int) -> None:
    import torch

    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    cfg = ModelConfig.from_dict(
        {"modalities": {m: {"kind": "vector", "dim": dim} for m in NAMES}, "head": "hclip",
         "latent_dim": dim}
    )  # fmt: skip
    torch.manual_seed(0)
    save_model(MultimodalModel(cfg), path, overwrite=True)


def build(work: Path, name: str, *extra: str) -> Path:
    root = work / name
    if (root / "CURRENT").is_file():
        print(f"kept {name} (built before)", flush=True)
        return root
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(work / "model"),
           "--records", str(work / "records.jsonl"), "--root", str(root), "--quiet",
           *extra]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env_for(REPO), check=True, stdout=subprocess.DEVNULL)
    print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def disk_bytes(vdir: Path) -> dict[str, int]:
    """Bytes of the whole version and of its vectors (embeddings/, views/ but the rows
    files), each file once however many names it has."""
    seen: dict[int, tuple[str, int]] = {}
    for p in vdir.rglob("*"):
        if p.is_file():
            st = p.stat()
            seen.setdefault(st.st_ino, (p.relative_to(vdir).as_posix(), st.st_size))
    vectors = sum(size for rel, size in seen.values()
                  if rel.startswith(("embeddings/", "views/")) and ".rows." not in rel)  # fmt: skip
    return {"total": sum(size for _, size in seen.values()), "vectors": vectors}


def held_out_embeddings(work: Path, n: int, dim: int) -> dict[str, np.ndarray]:
    """(n, d) embeddings per modality of records that are not indexed."""
    import torch

    from models.checkpoint import load_model

    path = work / "held_out.jsonl"
    write_records(path, n, dim, seed=7, prefix="q")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    model = load_model(work / "model")
    with torch.no_grad():
        return {m: model.encode(m, [torch.tensor(r[m]) for r in rows]).numpy() for m in NAMES}


def truth(root: Path, view: str, xq: np.ndarray) -> tuple[np.ndarray, Any]:
    """Exact float32 top-k rows over the full version's view, and the version."""
    import faiss

    from indexer.store import artifact
    from indexer.store.version import LoadedVersion

    version = LoadedVersion(artifact.current_version_dir(root))
    v = version.views[view]
    _, pos = faiss.knn(xq, np.asarray(v.vectors), K, metric=faiss.METRIC_INNER_PRODUCT)
    return np.asarray(v.rows)[pos], version


def query_factors(work: Path, view: str, embs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    from models.checkpoint import load_model

    head = load_model(work / "model").head
    q = tuple(view.split("+"))
    with torch.no_grad():
        return head.query_factor({m: torch.from_numpy(embs[m]) for m in q}, q).numpy()


def start(root: Path, workers: int, port: int, code: Path = REPO) -> subprocess.Popen:
    env = env_for(code, HCLIP_ROOT=str(root), HCLIP_PORT=str(port), HCLIP_CACHE_TTL_S="1")
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    server = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    wait_ready(f"http://127.0.0.1:{port}", server, limit_s=600)
    return server


def through_api(url: str, embs: dict[str, np.ndarray], view: str) -> list[list[tuple[str, float]]]:
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(len(embs[NAMES[0]])):
            body = {"embeddings": {m: embs[m][i].tolist() for m in view.split("+")}, "k": K}
            r = client.post("/v1/search", json=body)
            r.raise_for_status()
            out.append([(h["id"], h["score"]) for h in r.json()["results"]])
    return out


def accuracy(
    answers: list[list[tuple[str, float]]], want: np.ndarray, full: Any, view: str, xq: np.ndarray
) -> dict[str, float]:
    """recall@10 against the exact rows; the largest |score - float32 exact| / |exact|."""
    v = full.views[view]
    position = {int(r): i for i, r in enumerate(np.asarray(v.rows))}
    hits, worst = 0, 0.0
    for q, found in enumerate(answers):
        rows = [full.records.row_of(rid) for rid, _ in found]
        hits += len(set(rows) & set(want[q].tolist()))
        for row, (_, score) in zip(rows, found, strict=True):
            exact = float(np.asarray(v.vectors[position[row]], np.float64) @ xq[q])
            worst = max(worst, abs(score - exact) / max(abs(exact), 1e-12))
    return {"recall@10": hits / (K * len(answers)), "max_rel_score_error": worst}


LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
math.randomseed(%d)
local names = {%s}
local function vec()
  local v = {}
  for i = 1, %d do v[i] = string.format("%%.4f", math.random() * 2 - 1) end
  return '[' .. table.concat(v, ",") .. ']'
end
request = function()
  local parts = {}
  for i, n in ipairs(names) do parts[i] = '"' .. n .. '": ' .. vec() end
  return wrk.format(nil, "/v1/search", nil,
    '{"embeddings": {' .. table.concat(parts, ",") .. '}, "k": %d}')
end
"""


def load(url: str, view: str, dim: int, seconds: float) -> dict[str, Any]:
    names = ",".join(f'"{n}"' for n in view.split("+"))
    wrk(url, 32, min(seconds, 3.0), LUA % (99, names, dim, K), WRK_TIMEOUT_S)  # warm-up
    return wrk(url, 32, seconds, LUA % (2, names, dim, K), WRK_TIMEOUT_S)


def serve_and_measure(
    root: Path, args: argparse.Namespace, port: int, embs: dict[str, np.ndarray], ref: dict
) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    server = start(root, args.workers, port)
    try:
        views = {}
        for view, (xq, want, full) in ref.items():
            views[view] = accuracy(through_api(url, embs, view), want, full, view, xq)
        served = {view: load(url, view, args.dim, args.seconds) for view in LOADS}
        return {"views": views, "served_32": served}
    finally:
        stop(server)


def served_by(root: Path, args: argparse.Namespace, code: Path) -> dict[str, Any]:
    """The loads alone, served by the checkout `code` (a change's before and after)."""
    url = f"http://127.0.0.1:{args.port}"
    server = start(root, args.workers, args.port, code)
    try:
        return {view: load(url, view, args.dim, args.seconds) for view in LOADS}
    finally:
        stop(server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=200, help="held-out queries per view")
    p.add_argument("--seconds", type=float, default=8.0, help="each wrk load")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--work", type=Path, help="keep records and versions here (default: a temp)")
    p.add_argument("--compact-spec", action="append", help="a compact version's --spec")
    p.add_argument("--build-only", action="store_true", help="make records and versions only")
    p.add_argument(
        "--before",
        type=Path,
        help="a checkout of earlier code (git worktree add DIR REV): each compact version's "
        "loads served by it too, after this checkout's",
    )
    args = p.parse_args()
    require_wrk()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-compact-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "records.jsonl").is_file():
        write_records(work / "records.tmp", args.records, args.dim, seed=0)
        (work / "records.tmp").rename(work / "records.jsonl")  # whole, or not there
    if not (work / "model").is_dir():
        make_model(work / "model", args.dim)
    full_root = build(work, "full")
    roots = {"full": full_root}
    for spec in args.compact_spec or ["sq8:rerank=10"]:
        name = f"compact[{spec}]"
        roots[name] = build(work, name.replace(":", "_"), "--compact", "--spec", spec)
    if args.build_only:
        return

    from indexer.store import artifact

    embs = held_out_embeddings(work, args.queries, args.dim)
    ref = {}
    views = artifact.read_manifest(artifact.current_version_dir(full_root))["views"]
    for view in views:
        xq = query_factors(work, view, embs)
        want, full = truth(full_root, view, xq)
        ref[view] = (xq, want, full)
    sizes = {name: disk_bytes(artifact.current_version_dir(root)) for name, root in roots.items()}
    figures = {name: serve_and_measure(root, args, args.port, embs, ref)
               for name, root in roots.items()}  # fmt: skip
    if args.before is not None:
        for name, root in roots.items():
            if name != "full":
                figures[name]["served_32_before"] = served_by(root, args, args.before)
    for name in roots:
        if name != "full":
            report(args, name, sizes, figures)
    print("\n" + json.dumps({"sizes": sizes, "figures": figures}))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def report(args: argparse.Namespace, name: str, sizes: dict, figures: dict) -> None:
    full, comp = sizes["full"], sizes[name]
    print(f"\n{name} against full: {args.records} records x 3 modalities, d = {args.dim}, "
          f"{args.queries} held-out queries a view, {args.workers} workers")  # fmt: skip
    print(f"{'bytes on disk':<24}{'full':>16}{'compact':>16}{'ratio':>8}")
    for key in ("total", "vectors"):
        print(f"{key:<24}{full[key]:>16,}{comp[key]:>16,}{comp[key] / full[key]:>8.3f}")
    head = f"{'view':<12}{'recall@10 full':>16}{'compact':>10}"
    print(f"\n{head}{'max rel err full':>18}{'compact':>10}")
    for view, f in figures["full"]["views"].items():
        c = figures[name]["views"][view]
        print(f"{view:<12}{f['recall@10']:>16.3f}{c['recall@10']:>10.3f}"
              f"{f['max_rel_score_error']:>18.2e}{c['max_rel_score_error']:>10.2e}")  # fmt: skip
    print(f"\n{'32 connections':<16}{'full q/s':>10}{'p50 ms':>8}{'compact q/s':>13}{'p50 ms':>8}")
    for view in LOADS:
        f, c = figures["full"]["served_32"][view], figures[name]["served_32"][view]
        print(f"{view:<16}{f['qps']:>10.1f}{f['p50_ms']:>8.1f}{c['qps']:>13.1f}{c['p50_ms']:>8.1f}")
    if "served_32_before" in figures[name]:
        print(
            f"\n{'32 connections':<16}{'before q/s':>12}{'p50 ms':>8}{'after q/s':>11}{'ratio':>7}"
        )
        for view in LOADS:
            b, a = figures[name]["served_32_before"][view], figures[name]["served_32"][view]
            print(f"{view:<16}{b['qps']:>12.1f}{b['p50_ms']:>8.1f}{a['qps']:>11.1f}"
                  f"{a['qps'] / max(b['qps'], 1e-9):>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
