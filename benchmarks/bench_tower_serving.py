"""Raw queries through real-size towers, served, against what the bare tower allows. Prints
figures; it is not a test (a shared machine is noisy).

    python benchmarks/bench_tower_serving.py                       # text, image, audio; torch
    python benchmarks/bench_tower_serving.py --runtimes torch,onnx,onnx-int8 --modalities text
    python benchmarks/bench_tower_serving.py --work DIR --seconds 10   # towers and index kept
    python benchmarks/bench_tower_serving.py --before ../before --rounds 3  # a change's effect
    python benchmarks/bench_tower_serving.py --repeat 3     # each ratio's spread, in turn
    python benchmarks/bench_tower_serving.py --pairs 400    # lone queries: a median to ~1 ms
    python benchmarks/bench_tower_serving.py --per-request 1,8  # and 8 queries a request

The towers and records are bench_towers.py's: ViT-B/16 (224 x 224), wav2vec 2.0 base (5-s clips
at 16 kHz) random-initialised from `transformers`' config classes, and the packaged MiniLM; the
H-CLIP model over them is untrained (d = 256), and its index holds --records records (the
search itself costs microseconds beside a tower). For each query modality and runtime
(HCLIP_ENCODER_RUNTIME), in one run:
- limit: the bare tower on all cores, inputs decoded beforehand: its single forward (median of
  batch-1 calls, one process with every core's thread), from the decoded input through the
  tower's processor and model as `transformers` runs them (a text's tokenizer, an image's
  processor, a clip's feature extractor; the image processor's share is printed); the median
  decode of those raw inputs timed apart (what a raw query costs before its tower: the base64
  and the file's format, a PNG's or a WAV's; the bar on p50 does not allow for it); and its
  throughput at the batch size the service formed at 32 connections (read from
  /metrics), the larger of one process with every core's thread and one process per worker
  with its share (tokenizers without its Rayon pool, as `hclip serve` runs it), run together;
  its inputs are the served pool's (distinct, as the served queries are); it runs while the
  server idles between two 32-connection loads, and served q/s is their mean: a drift of the
  machine's pace over the run shows as the gap between the two (printed);
- served: `hclip serve --workers CORES`, caches off (HCLIP_CACHE_MAX_BYTES=0, no Redis), every
  tower of the model having first answered lone queries in every worker (a server serves them
  all, and what one tower leaves in a worker can slow another: app/services/threads.py), queries
  drawn in turn from a pool of distinct inputs (text: every query its own sentence), by wrk at
  1 connection (p50) and 32 connections (q/s answered with results; the request deadline is
  raised to the load's timeout, so that a queue of slow queries is measured, not the deadline);
- with --per-request N > 1, the same distinct queries go N to a /v1/search/batch request, and
  served q/s counts queries: what a client's own batching buys (the bars are on single queries);
- wrk's own CPU during the 32-connection load, in cores (it shares this machine's cores);
- the ratios the issue sets bars on: served q/s / limit q/s, and p50 - single forward (and p50
  - decode - single forward: what the service adds beyond a raw query's own work); and the
  latter taken in turn (`in turn`, lone_in_turn): lone queries to the server idle between the
  loads alternating with the bare tower's single forward of the same inputs (each on a team
  thread placed as a worker's is: app.services.threads.TeamThread), the median of the
  pairs' differences and its standard error, over --pairs pairs at least (a lone query
  follows an idle moment, and on a shared VM a forward after one can be a tenth slower than
  the limit's back-to-back forwards, far more than the 3 ms the bar allows: medians taken
  minutes apart, in two states, do not resolve it; a ViT-B/16 forward varies by tens of ms
  from one to the next here, and a median within about 1 ms takes 400 pairs), split by the
  service's own Server-Timing into its path outside the encode call (HTTP, checks, queues,
  search, format) and its encode call over the bare forward (thread hops, decode, the
  forward's own variance), that call in turn into its hops, its decode (an image's
  processor included) and its forward over the bare one (the model's forward as the
  service timed it, on the thread it ran on); with
  --repeat N, served and limit are measured N times in turn, and their medians and ranges
  printed (on a shared VM a lone ratio moves by a tenth or more between runs); with --before,
  an earlier checkout's q/s, p50 and lone queries in turn beside this one's;
- where the server's CPU went for the first 32-connection load, per query its tower encoded
  (each thread's utime + stime from /proc, read before the load and once the calls in flight
  when it stopped have ended): the workers' event loops (their main threads: HTTP,
  checks, search, responses) and their other threads (the encode threads with their pools), beside
  the bare tower's CPU per query at the limit (cores / limit q/s). When the server keeps the
  cores busy, served / limit is about bare / (loop + threads): what the loops take is what the
  tower does not get, a figure that the machine's drift moves less than a ratio of two q/s;
- a full garbage collection's pause in a worker's heap (every tower loaded, a version served),
  with what the version holds frozen as the service keeps it (app/services/heap.py) and thawed:
  the GIL is held for that long, and no request of that worker moves;
- connections per worker: wrk's 32 connections, counted in each worker's open sockets (/proc);
- busy threads: during the 32-connection run, /proc is read every 50 ms for the threads of the
  server's processes that are running (state R); the mean and the largest count;
- for ONNX runtimes, the share of each of the first 50 queries' top-10 ids that torch's top-10
  holds too, through the API.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.client
import io
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_image_decode  # noqa: E402  (photo-like JPEGs)
import bench_server  # noqa: E402  (wrk, wait_ready, cpu_model)
import bench_towers  # noqa: E402  (the towers, records and model)

from app.client import server_timing  # noqa: E402  (the service's Server-Timing, by stage)
from models.machine import usable_cores  # noqa: E402

QUERY_OF = {"text": "caption", "image": "photo", "audio": "sound"}
POOL = {"text": 4000, "image": 96, "audio": 24}  # distinct queries per modality
OVERLAP_QUERIES = 50  # queries whose top-10 is compared between runtimes

WRK_POOL = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = %d
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "%s", nil, bodies[i])
end
"""


def query_pool(
    kind: str, n: int, seconds: float, seed: int = 1, photo: tuple[int, int] | None = None
) -> list[str]:
    """n distinct raw queries: sentences, PNG data URIs (256 x 256; with `photo`, photo-like
    JPEGs of that width and height) or WAV data URIs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    if kind == "image" and photo is not None:
        jpegs = (bench_image_decode.photo(*photo, seed=i) for i in range(n))
        return ["data:image/jpeg;base64," + base64.b64encode(j).decode() for j in jpegs]
    if kind == "text":
        words = bench_towers.WORDS
        return [
            " ".join(words[j] for j in rng.integers(0, 10, 6)) + f" number {i}" for i in range(n)
        ]
    out = []
    for i in range(n):
        buf = io.BytesIO()
        if kind == "image":
            img = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(img).resize((256, 256)).save(buf, format="PNG")
            out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        else:
            rate = 16000
            t = np.arange(int(rate * seconds)) / rate
            x = 0.3 * np.sin(2 * np.pi * (200 + 11 * i) * t) + 0.02 * rng.standard_normal(len(t))
            with wave.open(buf, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(rate)
                w.writeframes((x * 32767).astype("<i2").tobytes())
            out.append("data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


# The bare tower, in a process of its own: argv[1] the model, argv[2] the modality, argv[3]
# the pool of raw inputs (JSON). `single(i)` times the i-th input's decode, the processor's
# share (images) and the single forward from the decoded input.
TOWER = """
import json, os, statistics, sys, time, torch
from pathlib import Path
if os.environ.get("BENCH_TEAM_THREAD"):  # loaded as a worker loads, on one torch thread
    torch.set_num_threads(1)
from models.checkpoint import load_model
from models.encoders import decode
from models.encoders.runtime import Runtime
from models.limits import DEFAULT_LIMITS
runtime = Runtime(os.environ["HCLIP_ENCODER_RUNTIME"], Path(sys.argv[1]) / "onnx",
                  int(os.environ["HCLIP_TORCH_THREADS"]))  # as the service makes it
model = load_model(Path(sys.argv[1])).to_inference("auto", runtime=runtime)
name, values = sys.argv[2], json.load(open(sys.argv[3]))
cfg = model.cfg.modalities[name]
items = [decode(v, cfg, None, DEFAULT_LIMITS) for v in values]
# An image's tower starts at its processor, as a text's does at its tokenizer and a clip's at
# its feature extractor (the service runs an image's processor where it decodes the file).
image = cfg.kind == "transformers" and cfg.input == "image"
if image:
    from models.encoders.image import decode_image_file
    from models.encoders.media import read_bytes
    from models.encoders.tower_inputs import image_side, preprocess_image
    side = image_side(cfg)

def single(i):  # seconds: the raw input's decode, its processor (images), its single forward
    v, x = values[i % len(values)], items[i % len(items)]
    t0 = time.perf_counter()
    if image:  # the file's bytes to an RGB image, then the processor's pixels
        pil = decode_image_file(read_bytes(v, None, "image", DEFAULT_LIMITS), DEFAULT_LIMITS,
                                "RGB", side)
        t1 = time.perf_counter()
        x = preprocess_image(pil, cfg)
    else:
        decode(v, cfg, None, DEFAULT_LIMITS)  # what a raw query costs before its tower
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    with torch.inference_mode():
        model.encode(name, [x])
    return t1 - t0, t2 - t1, time.perf_counter() - t1

with torch.inference_mode():
    for x in items[:3]:
        model.encode(name, [x])  # loaded, exported where the runtime exports, warm
"""

BARE = (
    TOWER
    + """
batch, seconds, start_at = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
singles, decodes, processors = [], [], []
if sys.argv[7] == "1":
    for i in range(max(5, min(30, len(items)))):
        took = single(i)
        decodes.append(took[0]); processors.append(took[1]); singles.append(took[2])
with torch.inference_mode():
    model.encode(name, items[:batch])
    time.sleep(max(0.0, start_at - time.time()))  # processes measured together start together
    n, t0 = 0, time.perf_counter()
    while n < max(2 * batch, 16) or time.perf_counter() - t0 < seconds:
        s = n % max(1, len(items) - batch + 1)
        model.encode(name, items[s : s + batch]); n += batch
    took = time.perf_counter() - t0
print(json.dumps({"single_ms": 1e3 * statistics.median(singles) if singles else None,
                  "decode_ms": 1e3 * statistics.median(decodes) if decodes else None,
                  "processor_ms": 1e3 * statistics.median(processors) if processors else None,
                  "qps": n / took}))
"""
)

# The same tower, answering on request: a line with the input's number in, its single
# forward's seconds out (the lone queries below alternate with the service's). With
# BENCH_TEAM_THREAD, each forward runs on a team thread as a worker's lone query does, its
# OpenMP team placed on the cores (app.services.threads.TeamThread), and is timed there.
ON_REQUEST = (
    TOWER
    + """
answer = single
if os.environ.get("BENCH_TEAM_THREAD"):
    from app.services.threads import TeamThread
    team = TeamThread(0, int(os.environ["HCLIP_TORCH_THREADS"]))
    answer = lambda i: team.run(team.size, lambda: single(i))
    for i in range(3):
        answer(i)
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(answer(int(line))[1:]), flush=True)  # the processor's, the single forward
"""
)


HEAP = """
import gc, json, sys, time
from fastapi.testclient import TestClient
from app.main import create_app
json_type = {"content-type": "application/json"}
with TestClient(create_app()) as client:  # a worker's heap: a version loaded, warmed, served
    assert client.get("/readyz").status_code == 200
    frozen = gc.get_freeze_count()
    t0 = time.perf_counter()
    for body in open(sys.argv[1]).read().splitlines():  # what requests leave behind
        if time.perf_counter() - t0 > float(sys.argv[2]):
            break
        r = client.post("/v1/search", content=body, headers=json_type)
        assert r.status_code == 200, r.text
    took = {}
    for state in ("frozen", "thawed"):
        if state == "thawed":
            gc.unfreeze()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter(); gc.collect(); runs.append(time.perf_counter() - t0)
        took[state] = 1e3 * sorted(runs)[2]
print(json.dumps({"objects_frozen": frozen, "full_collection_ms": took}))
"""


def heap_pauses(root: Path, runtime: str, bodies: Path, seconds: float) -> dict[str, Any]:
    """A full garbage collection's pause in a worker's heap (every tower loaded under
    `runtime`, `seconds` of the queries in `bodies` answered), with what the loaded version
    holds frozen, as the service keeps it, and thawed: the GIL is held for that long, and no
    request moves."""
    env = bench_server.env_for(REPO, HCLIP_ROOT=str(root), HCLIP_ENCODER_RUNTIME=runtime)
    out = subprocess.run(
        [sys.executable, "-c", HEAP, str(bodies), str(seconds)],
        env=env, cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"the heap's pauses were not measured:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def bare(
    model: Path, name: str, batch: int, pool: Path, seconds: float, runtime: str
) -> dict[str, Any]:
    """The tower alone on all cores, two ways: one process with every core's thread (its
    single forward, and its throughput), and one process per worker with their share of the
    cores, together (their summed throughput). The limit is the larger throughput."""
    cores, workers = usable_cores(), usable_cores()

    def start(threads: int, single: bool, start_at: float) -> subprocess.Popen[str]:
        env = bench_towers.env_for(
            threads, HCLIP_ENCODER_RUNTIME=runtime, HCLIP_TORCH_THREADS=str(threads)
        )
        if not single:  # processes beside each other run tokenizers as the service does
            env["TOKENIZERS_PARALLELISM"] = "false"
        argv = [str(model), name, str(pool), str(batch), str(seconds), str(start_at)]
        return subprocess.Popen(
            [sys.executable, "-c", BARE, *argv, "1" if single else "0"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"the bare tower run failed ({proc.returncode})")
        return dict(json.loads(out.strip().splitlines()[-1]))

    one = result(start(cores, True, 0.0))
    at = time.time() + 30.0  # every process loaded and warm by then
    procs = [start(max(1, cores // workers), False, at) for _ in range(workers)]
    shared = sum(result(p)["qps"] for p in procs)
    return {
        "single_ms": one["single_ms"],
        "decode_ms": one["decode_ms"],
        "processor_ms": one["processor_ms"],
        "batch": batch,
        "qps_one_process": one["qps"],
        "qps_per_worker_processes": shared,
        "qps": max(one["qps"], shared),
    }


def server_pids(root_pid: int) -> list[int]:
    """The server and every process below it (uvicorn's spawned workers)."""
    pids, frontier = [root_pid], [root_pid]
    while frontier:
        pid = frontier.pop()
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        pids += [int(k) for k in kids]
        frontier += [int(k) for k in kids]
    return pids


def thread_stats(pids: list[int]) -> Iterator[tuple[int, str, list[str]]]:
    """(pid, tid, the fields of /proc/PID/task/TID/stat after the name) of each thread of
    these processes (state first, then ppid...; utime and stime are fields 11 and 12)."""
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            yield pid, tid, stat[stat.rindex(")") + 2 :].split()


def running_threads(pids: list[int]) -> tuple[int, int]:
    """(threads in state R, threads) of these processes, from /proc."""
    states = [fields[0] for _, _, fields in thread_stats(pids)]
    return states.count("R"), len(states)


def cpu_by_role(root_pid: int, pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the workers' main threads (`loop`), of their other threads
    (`threads`: encodes, searches, pools) and of the server's own process (`server`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "threads": 0.0, "server": 0.0}
    for pid, tid, fields in thread_stats(pids):
        role = "server" if pid == root_pid else "loop" if tid == str(pid) else "threads"
        out[role] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def connections_per_process(pids: list[int], port: int) -> list[int]:
    """Established TCP connections to `port` that each process holds (most first): how the
    load's connections were spread over the workers."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    counts = []
    for pid in pids:
        held = 0
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                held += link.startswith("socket:[") and link[8:-1] in inodes
        except OSError:
            continue
        counts.append(held)
    return sorted((c for c in counts if c), reverse=True)


def wait_idle(pids: list[int], limit_s: float = 300.0) -> None:
    """Until no thread of the server runs for half a second (the calls running when a load
    stopped have finished; the queries its closed connections left queued are dropped)."""
    quiet, t0 = 0, time.monotonic()
    while quiet < 5 and time.monotonic() - t0 < limit_s:
        quiet = quiet + 1 if running_threads(pids)[0] == 0 else 0
        time.sleep(0.1)


def top_ids(url: str, bodies: Path, n: int) -> list[list[str]]:
    """The top-10 ids of the pool's first n queries, one at a time: runtimes compared."""
    import httpx

    out = []
    with httpx.Client(timeout=120) as client:
        for line in bodies.read_text().splitlines()[:n]:
            r = client.post(url + "/v1/search", content=line,
                            headers={"content-type": "application/json"})  # fmt: skip
            r.raise_for_status()
            out.append([x["id"] for x in r.json()["results"]])
    return out


def overlap(a: list[list[str]], b: list[list[str]]) -> float:
    """Mean share of one top-10 found in the other, query by query."""
    return statistics.mean(len(set(x) & set(y)) / max(1, len(x)) for x, y in zip(a, b, strict=True))


def encode_batches(url: str, name: str) -> tuple[float, float]:
    """(inputs, calls) of the modality's encoder so far, summed over the workers."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    pat = rf'^hclip_encode_batch_size_(sum|count)\{{[^}}]*modality="{name}"[^}}]*\}} ([\d.e+]+)$'
    got = {k: float(v) for k, v in re.findall(pat, text, re.M)}
    return got.get("sum", 0.0), got.get("count", 0.0)


# Between a lone query and the bare forward: libgomp's threads spin a few ms before they
# sleep (the bare tower keeps its default), and one process's spinning would slow the other's.
IDLE_S = 0.05


def lone_in_turn(
    model: Path,
    name: str,
    pool: Path,
    bodies: Path,
    runtime: str,
    seconds: float,
    pairs: int,
    url: str,
) -> dict[str, Any]:
    """Lone queries in turn with the bare tower's single forward of the same input, one at a
    time, for `seconds` and `pairs` pairs at least: a query to the service (its latency at the
    client, a keep-alive connection), then the input's single forward in a process of its own
    with every core's thread on a team thread placed as a worker's is (ON_REQUEST), each once
    the other's threads are idle (IDLE_S). The median of the pairs' differences is what the
    service adds to a lone query beyond its tower, both sides run from the same idle state and
    the machine's drift taken out."""
    cores = usable_cores()
    env = bench_towers.env_for(
        cores, HCLIP_ENCODER_RUNTIME=runtime, HCLIP_TORCH_THREADS=str(cores), BENCH_TEAM_THREAD="1"
    )
    tower = subprocess.Popen(
        [sys.executable, "-c", ON_REQUEST, str(model), name, str(pool)],
        env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert tower.stdin is not None and tower.stdout is not None
    split = urlsplit(url)
    # not httpx (top_ids): http.client adds 0.2 to 0.3 ms a request where httpx adds 0.6, which
    # would count against the service here (a bare Starlette route, 2,000 requests each)
    conn = http.client.HTTPConnection(split.hostname or "127.0.0.1", split.port, timeout=600)
    lines = bodies.read_text().splitlines()
    served_s: list[float] = []
    bare_s: list[float] = []
    # the encode call and, within it, the input's decode and the model's forward, as the
    # service's Server-Timing gives them
    encode_s: list[float] = []
    parts_s: list[tuple[float, float]] = []
    processor_s: list[float] = []  # an image's processor, in the bare single forward
    try:
        if tower.stdout.readline().strip() != "ready":
            raise SystemExit("the bare tower for lone queries did not start")
        until = time.perf_counter() + seconds
        while len(served_s) < pairs or time.perf_counter() < until:
            i = len(served_s)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/search", lines[i % len(lines)].encode(),
                         {"Content-Type": "application/json"})  # fmt: skip
            answer = conn.getresponse()
            answer.read()
            took = time.perf_counter() - t0
            if answer.status != 200:
                raise SystemExit(f"a lone query was answered {answer.status}")
            stages = server_timing(answer.getheader("server-timing"))
            call = stages.get(f"encode {name}")
            if call is not None:
                encode_s.append(call / 1e3)
            parts = stages.get(f"decode {name}"), stages.get(f"forward {name}")
            if parts[0] is not None and parts[1] is not None:
                parts_s.append((parts[0] / 1e3, parts[1] / 1e3))
            time.sleep(IDLE_S)
            tower.stdin.write(f"{i}\n")
            tower.stdin.flush()
            processor, forward = json.loads(tower.stdout.readline())
            bare_s.append(forward)
            processor_s.append(processor)
            served_s.append(took)
            time.sleep(IDLE_S)
    finally:
        conn.close()
        tower.kill()
        tower.wait()
    over = [1e3 * (s - b) for s, b in zip(served_s, bare_s, strict=True)]
    quartiles = statistics.quantiles(over, n=4)
    by_stage = {}
    if len(encode_s) == len(served_s):  # a service that says what its encode call took
        by_stage = {
            # the service's path: HTTP, checks, queues, search, format, all but the encode call
            "outside_encode_ms": statistics.median(
                1e3 * (s - e) for s, e in zip(served_s, encode_s, strict=True)
            ),
            # the encode call (its hops, the input's decode, the forward) over the bare forward
            "encode_over_single_ms": statistics.median(
                1e3 * (e - b) for e, b in zip(encode_s, bare_s, strict=True)
            ),
        }
    if by_stage and len(parts_s) == len(served_s):  # a service that times the call's parts
        by_stage |= {
            # the call's hops between threads (and its checks of the output)
            "hops_ms": statistics.median(
                1e3 * (e - d - f) for e, (d, f) in zip(encode_s, parts_s, strict=True)
            ),
            "decode_ms": statistics.median(1e3 * d for d, _ in parts_s),
            # the model's forward in the service over the bare tower's (an image's processor
            # runs in the service's decode)
            "forward_over_single_ms": statistics.median(
                1e3 * (f - (b - p))
                for (_, f), b, p in zip(parts_s, bare_s, processor_s, strict=True)
            ),
        }
    return {
        **by_stage,
        "pairs": len(over),
        "served_p50_ms": 1e3 * statistics.median(served_s),
        "single_ms": 1e3 * statistics.median(bare_s),
        "over_single_ms": statistics.median(over),
        "over_single_quartiles_ms": [quartiles[0], quartiles[2]],
        # a median's standard error, about 1.25 x sigma / sqrt(n), sigma taken as IQR / 1.35
        "over_single_se_ms": 1.25 * (quartiles[2] - quartiles[0]) / 1.35 / len(over) ** 0.5,
    }


def lone_query(url: str, body: str) -> float:
    """A search on a connection of its own: ms from sending it to its answer's last byte."""
    split = urlsplit(url)
    conn = http.client.HTTPConnection(split.hostname or "127.0.0.1", split.port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/search", body.encode(), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        took = 1e3 * (time.perf_counter() - t0)
    finally:
        conn.close()
    if answer.status != 200:
        raise SystemExit(f"a lone query was answered {answer.status}: {body[:80]}")
    return took


def every_tower_answers(url: str, bodies: list[str], workers: int) -> None:
    """Lone queries of every modality, each on a connection of its own, 8 per worker: the
    kernel spreads new connections over the workers' sockets, so every worker has almost surely
    answered each (two workers: all but a 1-in-128 chance)."""
    for body in bodies:
        for _ in range(8 * workers):
            lone_query(url, body)


def served(
    root: Path,
    name: str,
    bodies: Path,
    seconds: float,
    runtime: str,
    threads: str,
    port: int,
    timeout_s: float,
    code: Path = REPO,
    top10: bool = True,
    per_request: int = 1,
    between: Callable[[int], dict[str, Any]] | None = None,
    lone: Callable[[str], dict[str, Any]] | None = None,
    every_modality: list[str] | None = None,
) -> dict[str, Any]:
    """`hclip serve` from the checkout `code` (this one by default) under the loads; with
    `top10`, the first queries' top-10 ids too (runtimes compared). With `per_request` > 1,
    each line of `bodies` holds that many queries, sent to /v1/search/batch, and q/s counts
    queries. With `between`, it is called with the batch the 32-connection load formed while
    the server idles (the bare tower's limit), and that load is run again after it: a drift of
    the machine's pace between the two shows in their q/s. With `lone`, it is called with the
    server's URL after the 1-connection load (lone_in_turn). `every_modality`: a lone query's
    body for each modality of the model, answered first (every_tower_answers)."""
    path = "/v1/search" if per_request == 1 else "/v1/search/batch"
    workers = usable_cores()
    env = bench_server.env_for(
        code, HCLIP_ROOT=str(root), HCLIP_PORT=str(port), HCLIP_CACHE_MAX_BYTES="0",
        HCLIP_ENCODER_RUNTIME=runtime, HCLIP_MAX_PENDING="4096",
        # 32 image or audio queries queued wait longer than the default deadline (10 s): a load
        # that answers 503s measures the deadline, not the tower's pace
        HCLIP_REQUEST_TIMEOUT_S=str(timeout_s),
    )  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)  # the service sizes its own pools from cores and workers
    env.pop("HCLIP_TORCH_THREADS", None)
    if threads != "auto":
        env["HCLIP_TORCH_THREADS"] = threads
    cmd = [sys.executable, "-m", "app.cli", "serve", "--workers", str(workers)]
    server = subprocess.Popen(
        cmd, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # the first start under ONNX exports every tower before it is ready
        bench_server.wait_ready(url, server, limit_s=1800.0)
        every_tower_answers(url, every_modality or [], workers)
        n = len(bodies.read_text().splitlines())
        warm = max(4.0, seconds / 4)
        # every worker warm
        bench_server.wrk(url, 32, warm, WRK_POOL % (bodies, n // 2, path), timeout_s)
        pids = server_pids(server.pid)
        wait_idle(pids)  # the calls wrk's last requests started end before the next load
        one = bench_server.wrk(url, 1, seconds, WRK_POOL % (bodies, 0, path), timeout_s)
        wait_idle(pids)
        in_turn = {} if lone is None or per_request > 1 else {"lone_in_turn": lone(url)}
        samples: list[tuple[int, int]] = []
        result: dict[str, Any] = {}

        def run_load() -> None:
            result.update(
                bench_server.wrk(url, 32, seconds, WRK_POOL % (bodies, n // 3, path), timeout_s)
            )

        before = encode_batches(url, name)
        cpu_before = cpu_by_role(server.pid, pids)
        t = threading.Thread(target=run_load)  # wrk runs while /proc is read here
        t.start()
        time.sleep(min(2.0, seconds / 4))  # past the ramp-up
        spread = connections_per_process(pids, port)
        while t.is_alive():
            samples.append(running_threads(pids))
            time.sleep(0.05)
        t.join()
        cpu_end = cpu_by_role(server.pid, pids)
        result["answered_qps"] = answered(result) * per_request
        result["server_cores"] = sum(cpu_end[r] - cpu_before[r] for r in cpu_end) / seconds
        wait_idle(pids)
        # The CPU a query: all the server did for the load, the calls still running when wrk
        # stopped included, over the queries its tower encoded. Over wrk's answered requests
        # instead, a load of few slow queries (images: 32 in flight beside 30 answered) counts
        # the unanswered ones' calls against the answered.
        cpu_after = cpu_by_role(server.pid, pids)
        after = encode_batches(url, name)
        encoded = max(1.0, after[0] - before[0])
        result["cpu_ms_per_query"] = {
            role: 1e3 * (cpu_after[role] - cpu_before[role]) / encoded for role in cpu_after
        }
        calls = after[1] - before[1]
        batch = encoded / calls if calls else 1.0  # at 32 connections
        busy = [r for r, _ in samples[:-2]] or [0]
        extra: dict[str, Any] = {}
        if between is not None:
            extra["limit"] = between(max(1, round(batch)))
            wait_idle(pids)
            again = bench_server.wrk(url, 32, seconds, WRK_POOL % (bodies, n // 5, path), timeout_s)
            again["answered_qps"] = answered(again) * per_request
            extra["32_connections_again"] = again
        return {
            **extra,
            **in_turn,
            "1_connection": one,
            "32_connections": result,
            "encode_batch_mean": batch,
            "busy_threads_mean": statistics.mean(busy),
            "busy_threads_max": max(busy),
            "threads": max((t for _, t in samples), default=0),
            "connections_per_worker": spread,
            "top10": top_ids(url, bodies, OVERLAP_QUERIES) if top10 and per_request == 1 else [],
        }
    finally:
        bench_server.stop(server)


def answered(load: dict[str, Any]) -> float:
    """q/s of answers with results (a 503 past the deadline is no answer)."""
    return float(load["qps"]) * (1 - load["non_2xx"] / max(1, load["requests"]))


def before_and_after(
    before: Path, rounds: int, kind: str, runtime: str, serve: Callable[..., dict[str, Any]]
) -> list[dict[str, Any]]:
    """The same loads, and lone queries in turn with the bare tower (`serve`'s `lone`), served
    by an earlier checkout and by this one, in turn, `rounds` times: a change's effect as
    ratios of runs next to each other on one machine."""
    pairs = []
    for _ in range(rounds):
        pair: dict[str, Any] = {}
        for label, code in (("before", before), ("after", REPO)):
            srv = serve(code=code, top10=False)
            pair[label] = {
                "qps": srv["32_connections"]["answered_qps"],
                "p50_ms": srv["1_connection"]["p50_ms"],
                "batch": srv["encode_batch_mean"],
                "connections": srv["connections_per_worker"],
                "loop_cpu_ms": srv["32_connections"]["cpu_ms_per_query"]["loop"],
                "p99_ms": srv["32_connections"]["p99_ms"],
                "p99_1_ms": srv["1_connection"]["p99_ms"],
                # lone queries in turn with the same bare tower: the served median, and the
                # median of the pairs' differences
                "in_turn_p50_ms": srv["lone_in_turn"]["served_p50_ms"],
                "in_turn_over_ms": srv["lone_in_turn"]["over_single_ms"],
            }
        pair["qps_ratio"] = pair["after"]["qps"] / max(1e-9, pair["before"]["qps"])
        b, a = pair["before"], pair["after"]
        print(
            f"  {kind} {runtime}, before -> after: {b['qps']:.1f} -> {a['qps']:.1f} q/s at 32 "
            f"conn. (x{pair['qps_ratio']:.2f}), p50 {b['p50_ms']:.1f} -> {a['p50_ms']:.1f} ms, "
            f"p99 at 1 conn. {b['p99_1_ms']:.1f} -> {a['p99_1_ms']:.1f} ms, lone queries in "
            f"turn with the bare tower {b['in_turn_p50_ms']:.1f} -> {a['in_turn_p50_ms']:.1f} ms"
            f" (over it {b['in_turn_over_ms']:+.1f} -> {a['in_turn_over_ms']:+.1f}), at 32 "
            f"{b['p99_ms']:.1f} -> {a['p99_ms']:.1f} ms, "
            f"batch {b['batch']:.1f} -> {a['batch']:.1f}, event loops' CPU per query "
            f"{b['loop_cpu_ms']:.3f} -> {a['loop_cpu_ms']:.3f} ms, connections per worker "
            f"{b['connections']} -> {a['connections']}",
            flush=True,
        )
        pairs.append(pair)
    return pairs


def spread(rows: list[dict[str, Any]], kind: str, label: str) -> None:
    """The median and range of a runtime's repeated served / limit and p50 - single forward."""
    mine = [r for r in rows if (r["query"], r["label"]) == (kind, label)]
    for key, fmt in (
        ("ratio", "{:.2f}"),
        ("p50_over_single_ms", "{:+.1f} ms"),
        ("over_single_in_turn_ms", "{:+.1f} ms"),
    ):
        got = sorted(r[key] for r in mine if key in r)
        if not got:
            continue
        print(
            f"  {kind} {label}, {len(got)} repeats: {key} median "
            + fmt.format(statistics.median(got))
            + f" (from {fmt.format(got[0])} to {fmt.format(got[-1])})",
            flush=True,
        )


def build_index(model: Path, records: Path, root: Path) -> None:
    if (root / "CURRENT").exists():
        return
    subprocess.run(
        [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model), "--records",
         str(records), "--root", str(root), "--quiet"],
        env=bench_towers.env_for(usable_cores()), cwd=REPO, check=True,
    )  # fmt: skip


def towers_and_index(work: Path, records: int, clip_seconds: float) -> tuple[Path, Path]:
    """The towers, records and model in `work` (made once, bench_towers.prepare) and an index
    of the records published under `work`/root: the model's path and the root."""
    work.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(records=records, seconds=clip_seconds)
    records_file, model, _ = bench_towers.prepare(work, ns, usable_cores())
    root = work / "root"
    build_index(model, records_file, root)
    return model, root


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, help="keep the towers, records and index here")
    p.add_argument("--records", type=int, default=32, help="records in the index")
    p.add_argument("--clip-seconds", type=float, default=5.0, help="audio clips' length")
    p.add_argument("--seconds", type=float, default=20.0, help="each load's length")
    p.add_argument("--modalities", default="text,image,audio")
    p.add_argument("--runtimes", default="torch")
    p.add_argument(
        "--torch-threads",
        default="auto",
        help="HCLIP_TORCH_THREADS values to serve with, comma-separated (auto: the default)",
    )
    p.add_argument(
        "--per-request",
        default="1",
        help="queries per request, comma-separated: past 1, a client sends that many queries in "
        "one /v1/search/batch request (the bars are on 1; more shows what batching buys)",
    )
    p.add_argument(
        "--photo",
        help="WIDTHxHEIGHT: image queries are photo-like JPEGs of that size "
        "(bench_image_decode.py) instead of 256 x 256 PNGs",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=20,
        help="lone queries taken in turn with the bare tower's forward: at least this many "
        "pairs, however short the load (a ViT-B/16 median within 1 ms here takes hundreds)",
    )
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    p.add_argument(
        "--before",
        type=Path,
        help="a checkout of earlier code (git worktree add DIR REV): served in turn with this "
        "one, --rounds times, for each query and runtime (default threads)",
    )
    p.add_argument("--rounds", type=int, default=2, help="before/after pairs (with --before)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="served and limit measured this many times in turn for each runtime: the ratios' "
        "median and range (this machine's noise moves a lone ratio by tenths)",
    )
    args = p.parse_args()
    bench_server.require_wrk()
    if args.pairs < 4:
        p.error(f"--pairs: {args.pairs} is too few for a median and its quartiles (4 at least)")
    work = args.work or Path(tempfile.mkdtemp(prefix="hclip-tower-serving-"))
    cores = usable_cores()
    model, root = towers_and_index(work, args.records, args.clip_seconds)
    figures: dict[str, Any] = {"cpu": bench_server.cpu_model(), "cores": cores, "rows": []}
    print(f"{figures['cpu']}, {cores} cores; workers = {cores}; loads of {args.seconds:g} s")
    print(f"{'query':6} {'runtime':10} {'single':>8} {'decode':>7} {'limit':>8} {'batch':>6} "
          f"{'served':>8} {'ratio':>6} {'p50':>8} {'p50-1fw':>8} {'-decode':>8} {'in turn':>8} "
          f"{'busy':>9}")  # fmt: skip
    figures["heap"] = {}
    photo = None
    if args.photo:
        width, height = (int(v) for v in args.photo.lower().split("x"))
        photo = (width, height)
    every_modality = [  # one query of each, none of them in the measured pools
        json.dumps({"query": {name: query_pool(kind, 1, args.clip_seconds, seed=2)[0]}, "k": 10})
        for kind, name in QUERY_OF.items()
    ]
    for kind in args.modalities.split(","):
        name = QUERY_OF[kind]
        pool = query_pool(kind, POOL[kind], args.clip_seconds, photo=photo)
        values = work / f"pool-{kind}.json"
        values.write_text(json.dumps(pool))  # the limit's inputs are as distinct as the served
        bodies = work / f"bodies-{kind}.jsonl"
        queries = [{"query": {name: v}, "k": 10} for v in pool]
        bodies.write_text("".join(json.dumps(q) + "\n" for q in queries))
        timeout_s = {"text": 10.0, "image": 60.0, "audio": 240.0}[kind]
        # A load must hold many answers at 32 connections: slower towers get longer ones.
        seconds = args.seconds * {"text": 1, "image": 4, "audio": 8}[kind]
        for runtime in args.runtimes.split(","):
            heap = figures["heap"][f"{kind} {runtime}"] = heap_pauses(root, runtime, bodies, 5.0)
            took = heap["full_collection_ms"]
            print(f"{kind} {runtime}: a full garbage collection pauses a worker "
                  f"{took['frozen']:.1f} ms with the served heap frozen "
                  f"({heap['objects_frozen']} objects), {took['thawed']:.1f} ms thawed",
                  flush=True)  # fmt: skip
        configs = itertools.product(
            args.runtimes.split(","),
            args.torch_threads.split(","),
            [int(n) for n in args.per_request.split(",")],
        )
        for (runtime, threads, per), repeat in itertools.product(configs, range(args.repeat)):
            sent = bodies
            if per > 1:  # the same distinct queries, `per` to a request
                sent = work / f"bodies-{kind}-x{per}.jsonl"
                starts = range(0, len(queries) - per + 1, per)
                sent.write_text("".join(json.dumps({"queries": queries[i : i + per]}) + "\n"
                                        for i in starts))  # fmt: skip
            lone = functools.partial(
                lone_in_turn, model, name, values, bodies, runtime, seconds, args.pairs
            )
            srv = served(
                root, name, sent, seconds, runtime, threads, args.port, timeout_s, per_request=per,
                between=functools.partial(
                    bare, model, name, pool=values, seconds=min(args.seconds, 15.0),
                    runtime=runtime,
                ),
                lone=lone,
                every_modality=every_modality,
            )  # fmt: skip
            lim, batch = srv["limit"], srv["limit"]["batch"]
            # served: the two 32-connection loads around the limit's run, and how far apart
            loads = [srv[k]["answered_qps"] for k in ("32_connections", "32_connections_again")]
            served_qps = statistics.mean(loads)
            label = f"{runtime}/{threads}" + (f" x{per}" if per > 1 else "")
            row = {"query": kind, "runtime": runtime, "threads": threads, "per_request": per,
                   "label": label, "repeat": repeat, "limit": lim, "served": srv}  # fmt: skip
            row["served_qps"] = served_qps
            row["served_drift"] = (max(loads) - min(loads)) / served_qps
            row["ratio"] = served_qps / lim["qps"]
            cpu = srv["32_connections"]["cpu_ms_per_query"]
            row["bare_cpu_ms_per_query"] = 1e3 * usable_cores() / lim["qps"]
            # the ratio the CPU split predicts, were the cores kept busy and the tower at its pace
            row["cpu_ratio"] = row["bare_cpu_ms_per_query"] / (cpu["loop"] + cpu["threads"])
            row["p50_over_single_ms"] = srv["1_connection"]["p50_ms"] - lim["single_ms"]
            # what the service adds beyond the work a raw query needs: its decode and forward
            row["p50_over_decode_and_single_ms"] = row["p50_over_single_ms"] - lim["decode_ms"]
            in_turn = srv.get("lone_in_turn")
            if in_turn is not None:  # the same, lone queries and forwards taken in turn
                row["over_single_in_turn_ms"] = in_turn["over_single_ms"]
            torch_row = next((r for r in figures["rows"] if r["query"] == kind and
                              r["runtime"] == "torch" and r["served"]["top10"]), None)  # fmt: skip
            if torch_row is not None and runtime != "torch" and srv["top10"]:
                row["top10_overlap_with_torch"] = overlap(
                    srv["top10"], torch_row["served"]["top10"]
                )
            figures["rows"].append(row)
            print(
                f"{kind:6} {label:10} {lim['single_ms']:7.1f}ms {lim['decode_ms']:5.1f}ms "
                f"{lim['qps']:8.1f} {batch:6d} "
                f"{served_qps:8.1f} {row['ratio']:6.2f} "
                f"{srv['1_connection']['p50_ms']:6.1f}ms {row['p50_over_single_ms']:+7.1f}ms "
                f"{row['p50_over_decode_and_single_ms']:+7.1f}ms "
                + (f"{in_turn['over_single_ms']:+7.1f}ms " if in_turn is not None else f"{'':9}")
                + f"{srv['busy_threads_mean']:4.1f}/{srv['busy_threads_max']:<3d}"
                + (
                    f" single: processor {lim['processor_ms']:.1f} + forward"
                    f" {lim['single_ms'] - lim['processor_ms']:.1f} ms"
                    if kind == "image"
                    else ""
                )
                + (
                    " in turn: {pairs} pairs, quartiles {0:+.1f} and {1:+.1f} ms, median's"
                    " standard error {se:.1f} ms".format(
                        *in_turn["over_single_quartiles_ms"],
                        pairs=in_turn["pairs"],
                        se=in_turn["over_single_se_ms"],
                    )
                    if in_turn is not None
                    else ""
                )
                + (
                    " (outside the encode call {:.1f} ms, the encode call over the single"
                    " forward {:+.1f} ms)".format(
                        in_turn["outside_encode_ms"], in_turn["encode_over_single_ms"]
                    )
                    if in_turn is not None and "outside_encode_ms" in in_turn
                    else ""
                )
                + (
                    " (within the call: hops {:.2f} ms, decode {:.2f} ms, the forward over the"
                    " single forward {:+.1f} ms)".format(
                        in_turn["hops_ms"], in_turn["decode_ms"], in_turn["forward_over_single_ms"]
                    )
                    if in_turn is not None and "hops_ms" in in_turn
                    else ""
                )
                + f" conn. {srv['connections_per_worker']}"
                f" served {loads[0]:.1f} then {loads[1]:.1f}"
                f" wrk {srv['32_connections']['client_cores']:.2f} cores"
                f" cpu/query: loop {cpu['loop']:.2f} + threads {cpu['threads']:.2f} ms"
                f" (server {srv['32_connections']['server_cores']:.2f} cores), bare"
                f" {row['bare_cpu_ms_per_query']:.2f} ms: {row['cpu_ratio']:.2f}"
                + (
                    f" top-10 vs torch {row['top10_overlap_with_torch']:.3f}"
                    if "top10_overlap_with_torch" in row
                    else ""
                ),
                flush=True,
            )
            if repeat == args.repeat - 1 > 0:
                spread(figures["rows"], kind, label)
            if args.before is not None and threads == "auto" and per == 1 and repeat == 0:
                serve = functools.partial(
                    served, root, name, bodies, seconds, runtime, "auto", args.port, timeout_s,
                    every_modality=every_modality, lone=lone,
                )  # fmt: skip
                row["before_and_after"] = before_and_after(
                    args.before, args.rounds, kind, runtime, serve
                )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
