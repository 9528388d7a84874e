"""Where a worker's event loop spends its CPU under load, by layer: uvicorn, Starlette and
FastAPI, the event loop's own machinery, the service's code, the metrics. Prints figures; it is
not a test (a shared machine is noisy).

    pip install py-spy
    python benchmarks/bench_loop_profile.py --work W --runtime onnx-int8

`W` is bench_tower_serving.py's work directory after a text run (its index root and its
text queries, `bodies-text.jsonl`). `hclip serve --workers CORES` serves W's index (caches off,
the runtime's towers); after a warm load, wrk sends the raw text queries at 32 connections
while py-spy samples one worker (`--gil --nonblocking`): only the samples of a thread that
holds the GIL, so a loop idle in epoll is not counted. py-spy's default counts it, as time in
the loop's C code: uvloop lets go of the GIL while it waits, and holds it while it runs its
callbacks, which py-spy shows as `Runner.run`. It prints the share of the worker's main thread
(its event loop) by layer, from each sample's innermost frame (a C call made from a Python
frame counts as that frame's: the socket writes of a response are uvicorn's `send`), and the
frames with the most samples. py-spy's samples are wall time with the GIL held, which counts a
thread preempted while it holds it (after a socket write wakes wrk, or a queue's put wakes the
encode thread); so where `perf` is installed and may sample, the same load goes on for as long
again while `perf record -e cpu-clock` samples that thread on its CPU, and the script prints
its CPU by library (`libpython`: the interpreter running Python code, whatever the layer).
Last, the workers' I/O system calls a request answered (/proc/PID/io: `syscr` and `syscw` over
the load, their threads' eventfd wake-ups included, over wrk's count).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (wrk, stop, cpu_model)
from bench_lone_mixed import start  # noqa: E402  (`hclip serve` on W's index, caches off)
from bench_tower_serving import WRK_POOL, server_pids, wait_idle  # noqa: E402

from models.machine import usable_cores  # noqa: E402

# (layer, how a frame's path begins as py-spy gives it: a package's or the repository's
# folder; `path:function` for one function), first match wins; the rest is `other`
LAYERS = (
    ("uvicorn: the response's socket writes", "uvicorn/protocols/http/httptools_impl.py:send"),
    ("uvicorn: parsing, the protocol, its middleware", "uvicorn/"),
    ("Starlette and FastAPI", "starlette/"),
    ("Starlette and FastAPI", "fastapi/"),
    ("pydantic (the body's model)", "pydantic"),
    ("the event loop (uvloop's own code), asyncio, concurrent.futures", "asyncio/"),
    ("the event loop (uvloop's own code), asyncio, concurrent.futures", "concurrent/"),
    ("metrics (prometheus_client, multiprocess)", "prometheus_client/"),
    # FastAPI's check of OpenTelemetry's providers a request (py-spy drops `opentelemetry/`)
    ("OpenTelemetry", "trace/"),
    ("OpenTelemetry", "metrics/_internal/"),
    ("OpenTelemetry", "_logs/"),
    ("the service: app/", "app/"),
    ("the service: models/, indexer/ (query factors, search)", "models/"),
    ("the service: models/, indexer/ (query factors, search)", "indexer/"),
    ("torch, numpy, FAISS called from the loop", "torch/"),
    ("torch, numpy, FAISS called from the loop", "numpy/"),
    ("torch, numpy, FAISS called from the loop", "faiss/"),
)


def layer_of(frame: str) -> str:
    """`frame` is py-spy's raw form, `function (path:line)`."""
    name, _, where = frame.rpartition(" (")
    path = where.rsplit(":", 1)[0]
    key = f"{path}:{name.rsplit('.', 1)[-1]}"
    for layer, part in LAYERS:
        if (key if ":" in part else path).startswith(part):
            return layer
    return "other"


def main_thread_samples(raw: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw stacks (`--threads`: each begins with `thread (TID): NAME`) of the main
    thread, the worker's event loop, without that first entry."""
    out = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if thread.endswith(": MainThread") and frames:
            out.append((frames, int(count)))
    return out


def io_calls(pids: list[int]) -> tuple[int, int]:
    """The read and write system calls these processes have made (/proc/PID/io)."""
    reads = writes = 0
    for pid in pids:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        reads, writes = reads + int(fields["syscr"]), writes + int(fields["syscw"])
    return reads, writes


def profile(work: Path, runtime: str, seconds: float, port: int, out: Path) -> dict[str, Any]:
    bodies = work / "bodies-text.jsonl"
    server = start(REPO, work / "root", runtime, port, usable_cores())  # ready when it returns
    url = f"http://127.0.0.1:{port}"
    n = len(bodies.read_text().splitlines())
    try:
        bench_server.wrk(url, 32, max(4.0, seconds / 2), WRK_POOL % (bodies, n // 2, "/v1/search"))
        pids = server_pids(server.pid)
        wait_idle(pids)
        # one worker (a single core) is the server's own process
        workers_pids = [p for p in pids if p != server.pid and _is_worker(p)] or [server.pid]
        load: dict[str, Any] = {}

        perf = shutil.which("perf")
        span = seconds * (2 if perf else 1)  # py-spy's samples, then perf's

        def run_load() -> None:  # a second longer on each side than the profilers sample
            load.update(bench_server.wrk(url, 32, span + 2, WRK_POOL % (bodies, 0, "/v1/search")))

        io_before = io_calls(workers_pids)
        loader = threading.Thread(target=run_load)
        loader.start()
        threading.Event().wait(1.0)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        subprocess.run(
            [spy, "record", "--gil", "--threads", "--nonblocking", "--rate", "1000",
             "--format", "raw", "-d", str(round(seconds)), "-p", str(workers_pids[0]),
             "-o", str(out)],
            check=True, capture_output=True,
        )  # fmt: skip
        by_library = cpu_by_library(perf, workers_pids[0], seconds, out) if perf else {}
        loader.join()
        io_after = io_calls(workers_pids)
    finally:
        bench_server.stop(server)
    answered = max(1, load["requests"])
    return {
        "qps": load["qps"],
        "by_library": by_library,
        "reads": (io_after[0] - io_before[0]) / answered,
        "writes": (io_after[1] - io_before[1]) / answered,
    }


def cpu_by_library(perf: str, tid: int, seconds: float, beside: Path) -> dict[str, float]:
    """The thread's CPU by the library its samples fell in (perf's `cpu-clock`, on-CPU only):
    `libpython` is the interpreter running Python code, whatever the layer; the kernel's share
    holds the system calls. {} where perf cannot sample here."""
    data = beside.with_suffix(".perf")
    got = subprocess.run(
        [perf, "record", "-e", "cpu-clock", "-F", "999", "-t", str(tid), "-o", str(data),
         "--", "sleep", str(round(seconds))],
        capture_output=True, text=True,
    )  # fmt: skip
    if got.returncode != 0:
        return {}
    report = subprocess.run(
        [perf, "report", "-i", str(data), "--sort", "dso", "--stdio"],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    out: dict[str, float] = {}
    for line in report.splitlines():
        share, _, library = line.strip().partition("%")
        if library and share.replace(".", "", 1).isdigit():
            out[library.strip()] = float(share)
    return out


def _is_worker(pid: int) -> bool:
    """uvicorn's workers are spawned processes (multiprocessing's spawn_main)."""
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="bench_tower_serving.py's --work")
    p.add_argument("--runtime", default="onnx-int8", help="HCLIP_ENCODER_RUNTIME")
    p.add_argument("--seconds", type=float, default=20.0, help="how long py-spy samples")
    p.add_argument("--top", type=int, default=15, help="frames listed by their own samples")
    p.add_argument("--port", type=int, default=8752)
    p.add_argument(
        "--stacks",
        type=Path,
        help="keep py-spy's raw stacks in this file (and perf's data beside it)",
    )
    args = p.parse_args()
    bench_server.require_wrk()
    if not (args.work / "bodies-text.jsonl").is_file() or not (args.work / "root").is_dir():
        raise SystemExit(f"{args.work}: no bodies-text.jsonl or root (see the docstring)")
    if not (shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists()):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="hclip-loop-") as scratch:
        raw = args.stacks or Path(scratch) / "stacks.txt"
        got = profile(args.work, args.runtime, args.seconds, args.port, raw)
        samples = main_thread_samples(raw)
    total = sum(c for _, c in samples)
    if not total:
        raise SystemExit("py-spy caught no sample of the worker's event loop holding the GIL")
    by_layer: collections.Counter[str] = collections.Counter()
    by_frame: collections.Counter[str] = collections.Counter()
    for frames, count in samples:
        by_layer[layer_of(frames[-1])] += count
        by_frame[frames[-1].rsplit(":", 1)[0] + ")"] += count
    print(f"{bench_server.cpu_model()}, {usable_cores()} workers, text queries, {args.runtime}")
    print(f"32 connections: {got['qps']:.1f} q/s while sampled; the workers' I/O system calls "
          f"a request: {got['reads']:.2f} reads, {got['writes']:.2f} writes")  # fmt: skip
    print(f"its event loop holding the GIL, {total} samples, by layer (own samples):")
    for layer, count in by_layer.most_common():
        print(f"  {100 * count / total:5.1f}%  {layer}")
    print(f"frames with the most own samples (of {total}):")
    for frame, count in by_frame.most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {frame}")
    if got["by_library"]:  # py-spy's samples are wall time with the GIL, perf's are CPU time
        print("its event loop's CPU by library (perf, cpu-clock), 0.5% and over:")
        for library, share in got["by_library"].items():
            if share >= 0.5:
                print(f"  {share:5.1f}%  {library}")


if __name__ == "__main__":
    main()
