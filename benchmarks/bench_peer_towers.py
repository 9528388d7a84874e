"""The same raw text queries through the same MiniLM, served by this service and by Infinity
(infinity-emb: the field's Python embedding server, on its ONNX Runtime engine), fp32 and int8,
beside the bare tower's limit taken in the same run. Prints figures; it is not a test.

    python -m venv ../infinity          # Infinity pins numpy < 2: an environment of its own
    ../infinity/bin/pip install 'torch==2.13.0' 'infinity-emb[server,optimum]==0.0.78' 'numpy<2'
    python benchmarks/bench_peer_towers.py --work W --infinity ../infinity [--rounds 2]

The tower is bench_tower_serving.py's text tower (the packaged all-MiniLM-L6-v2) and the queries
its pool of 4,000 distinct sentences, sent in the same order to both servers by wrk, at 1
connection (p50) and 32 connections (q/s). For each runtime, in turn, each round:

- Infinity: `infinity_emb v2 --engine optimum --device cpu --batch-size 32 --log-level
  warning` (no line logged a request), one process as Infinity runs, on a model folder made
  here from MiniLM's files: optimum's ONNX export of the model (`optimum-cli export onnx
  --task feature-extraction`, in Infinity's environment) for fp32, and for int8 that graph
  quantised as this service's `onnx-int8` quantises its own (onnxruntime's dynamic int8,
  per channel), named as Infinity looks for it on a CPU (`model_quantized.onnx`). Its request
  embeds the sentence (`POST /embeddings`);
- this service: `hclip serve --workers CORES` under `HCLIP_ENCODER_RUNTIME=onnx | onnx-int8`,
  caches off, as bench_tower_serving.py serves it. Its request embeds the sentence and
  searches the index (`POST /v1/search`, k = 10): more work than Infinity's;
- the limit: the bare tower of this service's runtime on all cores at the batch size the service
  formed (bench_tower_serving.bare), and its single forward.

Each server's CPU a query (every thread of its processes, from /proc) is printed beside its
q/s: on a machine whose cores the load generator shares, it is the figure that the machine's
pace moves least.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_server  # noqa: E402  (wrk, cpu_model, stop)
import bench_tower_serving as tower  # noqa: E402  (the towers, the pool, served, the limit)

SERVED_NAME = "minilm"
RUNTIMES = {"fp32": "onnx", "int8": "onnx-int8"}  # Infinity's graph -> this service's runtime
TOKENIZER_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
)  # fmt: skip
QUANTIZE = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8, per_channel=True)
"""


def infinity_folders(work: Path, minilm: Path, env_dir: Path) -> dict[str, Path]:
    """Infinity's model folders (fp32, int8), made once from MiniLM's files under `work`/infinity
    (made aside and renamed into place: an interrupted run leaves no half-made folder)."""
    home = work / "infinity"
    folders = {kind: home / kind for kind in RUNTIMES}
    if all(any(f.glob("*.onnx")) for f in folders.values()):
        return folders
    made = work / "infinity.partial"
    shutil.rmtree(made, ignore_errors=True)
    export = made / "export"
    run_in(env_dir, "optimum-cli", "export", "onnx", "--model", str(minilm),
           "--task", "feature-extraction", str(export))  # fmt: skip
    for kind in folders:
        folder = made / kind
        folder.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (minilm / name).exists():
                shutil.copy(minilm / name, folder / name)
        if (minilm / "1_Pooling").is_dir():
            shutil.copytree(minilm / "1_Pooling", folder / "1_Pooling")
        if kind == "fp32":
            shutil.copy(export / "model.onnx", folder / "model.onnx")
        else:
            quantized = str(folder / "model_quantized.onnx")
            run_in(env_dir, "python", "-c", QUANTIZE, str(export / "model.onnx"), quantized)
    shutil.rmtree(home, ignore_errors=True)
    os.replace(made, home)
    return folders


def run_in(env_dir: Path, program: str, *args: str) -> None:
    """A program of Infinity's environment; its error output in the message if it fails."""
    argv = [str(env_dir / "bin" / program), *args]
    out = subprocess.run(
        argv, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-2000:]}")


def infinity(
    env_dir: Path, folder: Path, kind: str, bodies: Path, seconds: float, port: int
) -> dict[str, Any]:
    """Infinity serving `folder` under the loads: q/s at 32 connections, p50 at 1, CPU a query."""
    cmd = [str(env_dir / "bin" / "infinity_emb"), "v2", "--model-id", ".",
           "--served-model-name", SERVED_NAME, "--engine", "optimum", "--device", "cpu",
           "--port", str(port), "--batch-size", "32", "--log-level", "warning"]  # fmt: skip
    if kind == "fp32":
        cmd.append("--onnx-do-not-prefer-quantized")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1", "HF_HOME": str(folder.parent / f"hf-{kind}")}  # fmt: skip
    log = folder.parent / f"{kind}.log"
    with open(log, "wb") as out:
        # Infinity finds a local folder's graph only by a path relative to it: it runs inside it
        server = subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            bench_server.wait_ready(url, server, limit_s=600.0, path="/health")
        except SystemExit as exc:
            raise SystemExit(f"Infinity ({kind}): {exc} (its log: {log})") from None
        return loads(url, "/embeddings", bodies, seconds, tower.server_pids(server.pid))
    finally:
        bench_server.stop(server)


def loads(url: str, path: str, bodies: Path, seconds: float, pids: list[int]) -> dict[str, Any]:
    """A warm-up, then 1 connection and 32 connections, as bench_tower_serving.served runs them."""
    n = len(bodies.read_text().splitlines())
    bench_server.wrk(url, 32, max(4.0, seconds / 4), tower.WRK_POOL % (bodies, n // 2, path), 10)
    tower.wait_idle(pids)
    one = bench_server.wrk(url, 1, seconds, tower.WRK_POOL % (bodies, 0, path), 10)
    tower.wait_idle(pids)
    before = sum(tower.cpu_by_role(-1, pids).values())
    many = bench_server.wrk(url, 32, seconds, tower.WRK_POOL % (bodies, n // 3, path), 10)
    cpu = sum(tower.cpu_by_role(-1, pids).values()) - before
    return {
        "qps": tower.answered(many),
        "p50_1_ms": one["p50_ms"],
        "cpu_ms_per_query": 1e3 * cpu / max(1, many["requests"]),
        "non_2xx": many["non_2xx"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="towers, index and folders, kept")
    p.add_argument("--infinity", type=Path, required=True,
                   help="the virtual environment infinity-emb is installed in")  # fmt: skip
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8796)
    p.add_argument("--out", type=Path, default=Path("bench-out/peer_towers.json"))
    args = p.parse_args()
    bench_server.require_wrk()
    env_dir = args.infinity.resolve()
    if not (env_dir / "bin" / "infinity_emb").exists():
        raise SystemExit(f"--infinity {env_dir}: no bin/infinity_emb in it (install: see --help)")
    work = args.work.resolve()
    model, root = tower.towers_and_index(work, 32, 5.0)
    minilm = Path(json.loads((work / "towers.json").read_text())["text"])
    folders = infinity_folders(work, minilm, env_dir)
    name = tower.QUERY_OF["text"]
    pool = tower.query_pool("text", tower.POOL["text"], 5.0)
    values = work / "pool-text.json"
    values.write_text(json.dumps(pool))
    ours = work / "bodies-text.jsonl"
    ours.write_text("".join(json.dumps({"query": {name: s}, "k": 10}) + "\n" for s in pool))
    theirs = work / "bodies-text-infinity.jsonl"
    asks = ({"model": SERVED_NAME, "input": [s]} for s in pool)
    theirs.write_text("".join(json.dumps(a) + "\n" for a in asks))
    figures: dict[str, Any] = {"cpu": bench_server.cpu_model(), "cores": tower.usable_cores(),
                               "seconds": args.seconds, "rounds": []}  # fmt: skip
    print(f"{figures['cpu']}, {figures['cores']} cores; MiniLM text queries, distinct")
    print(f"{'round':>5} {'graph':5} {'Infinity q/s':>12} {'hclip q/s':>9} {'x':>5} "
          f"{'limit q/s':>9} {'Inf/lim':>7} {'hclip/lim':>9} {'p50 Inf':>7} {'p50 hclip':>9} "
          f"{'single':>6} {'cpu/q Inf':>9} {'cpu/q hclip':>11}")  # fmt: skip
    for rnd in range(args.rounds):
        for kind, runtime in RUNTIMES.items():
            theirs_fig = infinity(env_dir, folders[kind], kind, theirs, args.seconds, args.port)
            srv = tower.served(
                root, name, ours, args.seconds, runtime, "auto", args.port, 10.0, top10=False
            )
            many = srv["32_connections"]
            ours_fig = {
                "qps": many["answered_qps"],
                "p50_1_ms": srv["1_connection"]["p50_ms"],
                "cpu_ms_per_query": sum(many["cpu_ms_per_query"].values()),
                "loop_ms_per_query": many["cpu_ms_per_query"]["loop"],
                "batch": srv["encode_batch_mean"],
            }
            limit = tower.bare(
                model, name, max(1, round(srv["encode_batch_mean"])), values,
                min(args.seconds, 15.0), runtime,
            )  # fmt: skip
            row = {"round": rnd, "graph": kind, "runtime": runtime, "infinity": theirs_fig,
                   "hclip": ours_fig, "limit": limit}  # fmt: skip
            figures["rounds"].append(row)
            lim = limit["qps"]
            print(f"{rnd:>5} {kind:5} {theirs_fig['qps']:>12.0f} {ours_fig['qps']:>9.0f} "
                  f"{ours_fig['qps'] / theirs_fig['qps']:>5.2f} {lim:>9.0f} "
                  f"{theirs_fig['qps'] / lim:>7.2f} {ours_fig['qps'] / lim:>9.2f} "
                  f"{theirs_fig['p50_1_ms']:>7.1f} {ours_fig['p50_1_ms']:>9.1f} "
                  f"{limit['single_ms']:>6.1f} {theirs_fig['cpu_ms_per_query']:>9.2f} "
                  f"{ours_fig['cpu_ms_per_query']:>11.2f}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
