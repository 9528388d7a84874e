"""Index build benchmark: the engines against the bare encoders, and peak memory of every
process. Prints figures; it is not a test (this machine is shared and noisy).

    python benchmarks/bench_indexer.py                       # 1M records, all four runs
    python benchmarks/bench_indexer.py --records 100000      # a quicker look
    python benchmarks/bench_indexer.py --runs local-jsonl ray-2
    python benchmarks/bench_indexer.py --sweep               # peak RSS by record count and batch
    python benchmarks/bench_indexer.py --repo ../before --runs local-parquet local-jsonl

Records have three 16-d `vector` modalities (a, b, c) and a small payload (as in
bench_scale.py); the model is an untrained H-CLIP with d = 64, so encoding is as cheap as it
gets and every other cost shows. The runs, each one `hclip index build` process:

    local-jsonl     the local engine on one JSON Lines file
    local-parquet   the local engine on the same records in Parquet (fixed-size float32 lists)
    ray-1, ray-2    the Ray engine on the JSON Lines file, 1 or 2 encoding actors, on a local
                    Ray that the build starts and stops (its start-up is in the figures)

Each run prints records/s over the whole process (interpreter start to exit) and its ratio to
the bare encoders (records/s through `model.encode` for the three modalities, inputs already
decoded in memory as one tensor per record, one thread, the same batch size), measured in three
passes right before and three right after each run (`bare`: on a shared machine that figure
drifts by a third within minutes, and a ratio to a figure taken minutes earlier drifts with
it). `ratio` is to their sustained rate (the passes' records over the passes' whole time): a
build encodes in one long pass, which the host slows now and then as it does the passes, and a
7-s pass of the networks alone ran at 0.86-0.98 of its own best second on a quiet 2-vCPU EPYC.
`(best)` is the ratio to the best single pass, the stricter figure that earlier versions of
this script printed as the ratio; `(net)` is the ratio to the networks alone
(`model.encode_batch` on stacked batches, the path the builds now take, which skips splitting a
batch into rows and stacking them back), sustained; then the phases the build logs, in seconds:
encode (read, check, encode and write the rows; for Ray also starting Ray and its actors) with
its own ratio to the bare encoders in brackets, views, and publish (checksums, the full check
of the staged version, shown apart as `check`, and fsync). torch runs one thread everywhere
(OMP_NUM_THREADS=1); the local engine also runs a forked reader process, and Ray one process
per actor. Peak RSS is each process's own high water mark (VmHWM, sampled from /proc every 0.2
s): the build's driver, the local engine's reader (forked: it shares the driver's pages until
either writes them, so the two overlap), every Ray worker (the encoding actors, read tasks),
and Ray's own processes (GCS, raylet, agents), summed. The parent stays small: it never imports
torch; the model and the bare timing run in children.

`--repo` builds with another checkout of this project (any version whose `hclip index build`
takes --model, --records, --root, --quiet and --batch-size), for before-and-after figures on one
machine: the records, the model and the bare encoders stay this checkout's, so only the build
differs. A version that logs no phases shows `-` for them.
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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DIMS = {"a": 16, "b": 16, "c": 16}
LATENT = 64
RUNS = ("local-jsonl", "local-parquet", "ray-1", "ray-2")
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
REPO = Path(__file__).resolve().parents[1]
TIMINGS = re.compile(r"timings: (.*)$", re.M)


def write_records(jsonl: str, parquet: str, n: int, seed: int = 0) -> None:
    """The same records twice: JSON Lines (orjson, as float32 prints) and Parquet."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    writer = None
    with open(jsonl, "wb") as f:
        for start in range(0, n, 50_000):
            m = min(50_000, n - start)
            cols = {k: rng.standard_normal((m, d)).astype(np.float32) for k, d in DIMS.items()}
            cats = rng.integers(0, 100, m)
            ids = [f"r{start + i}" for i in range(m)]
            payloads = [{"i": start + i, "category": f"c{cats[i]}"} for i in range(m)]
            lines = []
            for i in range(m):
                rec: dict[str, Any] = {"id": ids[i], "payload": payloads[i]}
                for k, v in cols.items():
                    rec[k] = v[i]
                lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"\n".join(lines) + b"\n")
            table = pa.table(
                {
                    "id": ids,
                    "payload": [orjson.dumps(p).decode() for p in payloads],
                    **{
                        k: pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
                        for k, v in cols.items()
                    },
                }
            )
            if writer is None:
                writer = pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table, row_group_size=50_000)
    if writer is not None:
        writer.close()


def make_model(path: str) -> Path:
    import torch

    from models.checkpoint import save_model
    from models.config import ModelConfig
    from models.model import MultimodalModel

    cfg = ModelConfig.from_dict(
        {
            "modalities": {k: {"kind": "vector", "dim": d} for k, d in DIMS.items()},
            "head": "hclip",
            "latent_dim": LATENT,
        }
    )
    torch.manual_seed(0)
    return save_model(MultimodalModel(cfg), path, overwrite=True)


def bare_encoder_rate(model_dir: str, n: int, batch: int, stacked: bool = False) -> str:
    """Records/s through the three encoders alone over three passes of `n` records, inputs
    already decoded in memory: as one tensor per record through model.encode (the reference
    of the ratios), or, with `stacked`, as a (batch, dim) tensor through model.encode_batch
    (the networks alone, the path the builds take). Returns JSON: the best pass, and the
    sustained rate (all the records of the three passes over their whole time), which is
    what a build's encoding, one long pass, can at best keep up on a shared host."""
    import torch

    from models.checkpoint import load_model

    torch.set_num_threads(1)
    model = load_model(Path(model_dir))
    rng = np.random.default_rng(1)
    x = {
        k: torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32)) for k, d in DIMS.items()
    }
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.no_grad():
            for start in range(0, n, batch):
                for k in DIMS:
                    if stacked:
                        model.encode_batch(k, x[k][start : start + batch])
                    else:
                        model.encode(k, list(x[k][start : start + batch]))
        times.append(time.perf_counter() - t0)
    return json.dumps({"best": n / min(times), "sustained": 3 * n / sum(times)})


class PeakSampler:
    """Every process under `root_pid`: its largest VmHWM seen and its latest command line."""

    def __init__(self, root_pid: int, every_s: float = 0.2):
        self.root = root_pid
        self.every = every_s
        self.peak_kb: dict[int, int] = {}
        self.name: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every)

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
        todo = [self.root]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
            if hwm:
                self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), int(hwm.group(1)))
                self.name[pid] = _role(pid == self.root, cmd)

    def by_role(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for pid, kb in self.peak_kb.items():
            out.setdefault(self.name[pid], []).append(kb / 1024)
        return {k: sorted(v, reverse=True) for k, v in sorted(out.items())}


def _role(is_driver: bool, cmd: list[bytes]) -> str:
    text = b" ".join(cmd).decode(errors="replace")
    if is_driver:
        return "driver"
    if "EncodeShards" in text:
        return "encode actor"
    if "app.cli" in text:  # forked from the driver: shares its pages until either writes
        return "reader (forked)"
    if text.startswith("ray::"):
        return "ray worker (reads, idle)"
    return "ray system"


def run_build(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd
    )
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read() if proc.stderr else b""))
    reader.start()
    with PeakSampler(proc.pid) as sampler:
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    reader.join()
    text = b"".join(err).decode(errors="replace")
    if status != 0:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{text[-3000:]}")
    found = TIMINGS.findall(text)
    timings = (
        dict((k, float(v)) for k, v in (item.split() for item in found[-1].split(", ")))
        if found
        else {}
    )
    roles = sampler.by_role()
    roles["driver"] = [usage.ru_maxrss / 1024]  # exact, from the kernel
    return {"wall_s": wall, "timings": timings, "peak_rss_mb": roles}


def build_cmd(model: Path, records: Path, root: Path, batch: int, run: str) -> list[str]:
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model)]
    cmd += ["--records", str(records), "--root", str(root), "--quiet", "--batch-size", str(batch)]
    if run.startswith("ray-"):
        cmd += ["--engine", "ray", "--workers", run.split("-")[1]]
    return cmd


def engines(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    n, batch = args.records, args.batch_size
    _child("make_model", str(work / "model"))
    model = work / "model"
    jsonl, parquet = work / f"records-{n}.jsonl", work / f"records-{n}.parquet"
    t0 = time.perf_counter()
    _child("write_records", str(jsonl), str(parquet), n)
    os.sync()  # the records on disk, as a user's are: no build pays for writing them back
    size = jsonl.stat().st_size / 1e6
    print(f"{n} records written in {time.perf_counter() - t0:.0f} s ({size:.0f} MB JSON Lines)")
    bare = json.loads(_child("bare_encoder_rate", str(model), min(n, 200_000), batch))
    print(
        f"bare encoders (model.encode, 1 thread, batch {batch}): {bare['sustained']:,.0f} "
        f"records/s sustained, best pass {bare['best']:,.0f}"
    )
    nets = json.loads(_child("bare_encoder_rate", str(model), min(n, 200_000), batch, True))
    net = nets["sustained"]
    print(
        f"the networks alone (model.encode_batch, stacked batches): {net:,.0f} records/s "
        f"sustained, best pass {nets['best']:,.0f}\n"
    )
    head = (
        f"{'run':<14} {'rec/s':>9} {'bare':>8} {'wall s':>7} {'ratio':>6} {'(best)':>6} "
        f"{'(net)':>6} "
        f"{'encode':>7} {'(ratio)':>7} {'views':>6} {'check':>6} {'publish':>7}  peak RSS MB"
    )
    print(head)
    results = {}
    for run in args.runs:
        records = parquet if run == "local-parquet" else jsonl
        root = work / f"root-{run}"
        os.sync()  # nothing left of the previous run for the disk to write during this one
        before = json.loads(_child("bare_encoder_rate", str(model), min(n, 100_000), batch))
        r = run_build(build_cmd(model, records, root, batch, run), env, cwd=args.repo)
        shutil.rmtree(root)  # a 1M-record version is about 2.5 GB: keep one at a time
        after = json.loads(_child("bare_encoder_rate", str(model), min(n, 100_000), batch))
        r["bare_rec_s"] = (before["sustained"] + after["sustained"]) / 2
        r["bare_best_rec_s"] = (before["best"] + after["best"]) / 2
        r["bare_before_after"] = [before, after]
        r["records_s"] = n / r["wall_s"]
        r["ratio"] = r["records_s"] / r["bare_rec_s"]
        r["ratio_best"] = r["records_s"] / r["bare_best_rec_s"]
        r["ratio_networks"] = r["records_s"] / net
        encode_s = r["timings"].get("encode_s")
        r["encode_ratio"] = n / encode_s / r["bare_rec_s"] if encode_s else None
        results[run] = r
        t = r["timings"]
        rss = "; ".join(
            f"{role} {', '.join(f'{x:.0f}' for x in peaks)}"
            if role != "ray system"
            else f"{role} {sum(peaks):.0f} (sum of {len(peaks)})"
            for role, peaks in r["peak_rss_mb"].items()
        )
        print(
            f"{run:<14} {r['records_s']:>9,.0f} {r['bare_rec_s']:>8,.0f} {r['wall_s']:>7.1f} "
            f"{r['ratio']:>6.2f} {r['ratio_best']:>6.2f} "
            f"{r['ratio_networks']:>6.2f} {_phase(t.get('encode_s'), 7, '.1f')} "
            f"{_phase(r['encode_ratio'], 7, '.2f')} "
            f"{_phase(t.get('views_s'), 6, '.1f')} {_phase(t.get('check_s'), 6, '.1f')} "
            f"{_phase(t.get('publish_s'), 7, '.1f')}  {rss}"
        )
    out = {"records": n, "batch": batch, "bare_encoder_rec_s": bare, "networks_rec_s": net}
    return {**out, "runs": results}


def _phase(seconds: float | None, width: int, spec: str) -> str:
    """A phase's figure, or `-` where the build did not log it (an older checkout)."""
    return f"{'-' if seconds is None else format(seconds, spec):>{width}}"


def machine() -> str:
    """The CPU and the OpenBLAS settings the figures were taken with: they differ between
    machines of one kind, and a figure means little without them."""
    from bench_server import cpu_model  # beside this script; it imports numpy only

    blas = ", ".join(f"{k}={os.environ[k]}" for k in OPENBLAS_VARS if k in os.environ)
    return (
        f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; "
        f"{blas or 'OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset'}"
    )


def sweep(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """The earlier table: the local engine's peak RSS by record count and batch size."""
    _child("make_model", str(work / "model"))
    model = work / "model"
    rows = []
    print(f"{'records':>9} {'batch':>6} {'peak RSS MB':>12} {'build s':>8} {'rec/s':>9}")
    for n in args.sizes:
        jsonl = work / f"records-{n}.jsonl"
        _child("write_records", str(jsonl), str(work / f"records-{n}.parquet"), n)
        for batch in args.batch_sizes:
            cmd = build_cmd(model, jsonl, work / f"root-{n}-{batch}", batch, "local")
            r = run_build(cmd, env, cwd=args.repo)
            rss = r["peak_rss_mb"]["driver"][0]
            rows.append({"records": n, "batch": batch, **r})
            print(f"{n:>9} {batch:>6} {rss:>12.0f} {r['wall_s']:>8.1f} {n / r['wall_s']:>9,.0f}")
    return {"sweep": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--sweep", action="store_true", help="peak RSS by record count and batch")
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--work", type=Path, help="keep records and indexes here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench-out/indexer.json"))
    p.add_argument(
        "--repo",
        type=Path,
        default=REPO,
        help="the checkout whose `hclip index build` runs (default: this one)",
    )
    args = p.parse_args()
    args.repo = args.repo.resolve()
    if not (args.repo / "app" / "cli.py").is_file():
        p.error(f"--repo {args.repo}: no app/cli.py there, not a checkout of this project")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(args.repo)}
    env.pop("RAY_ADDRESS", None)  # the Ray runs start their own local Ray
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp).resolve()  # absolute: with --repo the builds run in that checkout
        where = {"machine": machine(), "repo": str(args.repo), "commit": _commit(args.repo)}
        print(f"{where['machine']}\nbuilds by the checkout at {args.repo} ({where['commit']})")
        figures = sweep(args, work, env) if args.sweep else engines(args, work, env)
        figures.update(where)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures in {args.out}")


def _commit(repo: Path) -> str:
    """The checkout's commit, with `+changes` when its tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"]).returncode
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head + ("+changes" if dirty else "")


def _child(func: str, *args: str | int) -> str:
    """Run one of this module's functions in a fresh interpreter; its printed result back."""
    code = (
        f"import sys, json; sys.path[:0] = [{str(Path(__file__).parent)!r}, "
        f"{str(Path(__file__).parents[1])!r}]; import bench_indexer as b; "
        f"print(b.{func}(*json.loads(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return out.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    main()
