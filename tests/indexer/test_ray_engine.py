"""The Ray engine builds the same artifact as the local engine: same rows in the same order,
same record store and filter fields, same embeddings, same search results; updates, bad
records and a killed driver behave alike. One local Ray serves the whole module (starting one
takes seconds); builds in this process use it, and subprocesses connect to it by address."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from indexer.build.build_job import build
from indexer.build.options import JobOptions
from indexer.build.ray_address import ClusterError, check_reachable, host_port
from indexer.store import artifact
from indexer.store.verify import verify
from indexer.store.version import LoadedVersion
from tests.conftest import DIMS, index_build, make_model_dir, run_cli, vector_records, write_jsonl
from tests.indexer.test_bad_records import CASES, RAW_CASES, good
from tests.indexer.test_columnar import mm_model_dir

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not 10002 <= port <= 19999:  # Ray's default range for its workers' ports
            return port


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray for the module. Ray turns its token authentication on for a new local
    cluster, in this process's environment, so the CLI's subprocesses connect with it too."""
    for attempt in range(3):
        try:
            ray.init(
                address="local",  # a new one, whatever else runs on this machine
                num_cpus=2,
                include_dashboard=False,
                object_store_memory=256 * 1024 * 1024,
                log_to_driver=False,
                configure_logging=False,
            )
            break
        except Exception as exc:
            # Ray waits a fixed time for its raylet to register and for its GCS server to
            # write its port; on a loaded 2-core CI machine either start has missed it (the
            # raylet once in seven full runs; the GCS server once, with no log): start again.
            slow = ("timed out during startup", "Timed out waiting for file")
            if not any(s in str(exc) for s in slow) or attempt == 2:
                raise
            ray.shutdown()
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def ray_build(model: Path, records: Path, root: Path, *extra: object) -> int:
    return index_build(model, records, root, "--engine", "ray", "--workers", "2", *extra)


def records_with_gaps(n: int, seed: int = 0) -> list[dict]:
    rows = vector_records(n, DIMS, seed=seed, k=50)
    for i in range(0, n, 9):
        rows[i].pop("c")
    for i in range(4, n, 13):
        rows[i].pop("a")
    for i, r in enumerate(rows):
        r["payload"]["group"] = f"g{i % 3}"
    return rows


def assert_same_version(a: LoadedVersion, b: LoadedVersion) -> None:
    """What the server sees: rows, payloads, fields, embeddings, views and search results."""
    assert [a.records.payload_json(i) for i in range(len(a.records))] == [
        b.records.payload_json(i) for i in range(len(b.records))
    ]
    assert list(a.records) == list(b.records)
    assert np.array_equal(np.asarray(a.records.presence), np.asarray(b.records.presence))
    for n in a.names:
        ea, eb = np.asarray(a.stored.embeddings[n]), np.asarray(b.stored.embeddings[n])
        assert ea.shape == eb.shape and np.allclose(ea, eb, atol=1e-6), n
    ma, mb = a.manifest, b.manifest
    assert ma.keys() == mb.keys() and ma["counts"] == mb["counts"]
    assert ma["filter_fields"] == mb["filter_fields"] and ma["rejected"] == mb["rejected"]
    for name, field in ma["filter_fields"].items():
        value = 1 if field["type"] == "numeric" else "g1"
        assert np.array_equal(
            a.records.fields.evaluate({name: value}, len(a.records)),
            b.records.fields.evaluate({name: value}, len(b.records)),
        )
    assert sorted(a.views) == sorted(b.views)
    xq = np.random.default_rng(0).standard_normal((20, a.manifest["d"])).astype(np.float32)
    for name in a.views:
        sa, ra = a.views[name].search(xq, 10)
        sb, rb = b.views[name].search(xq, 10)
        assert np.allclose(sa, sb, atol=1e-5), name
        for q in range(len(xq)):
            assert same_ranking(sa[q], ra[q], rb[q], 1e-5), (name, q, ra[q], rb[q])
    assert verify(a.path) == [] and verify(b.path) == []


def same_ranking(scores: np.ndarray, a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """The same ids in the same order, except within runs of scores closer than `tol`: the two
    engines' embeddings agree to float rounding (each engine's BLAS sums in its own order), so
    near-tied records may come in either order, and the last run may be cut off by k."""
    start = 0
    for end in range(1, len(scores) + 1):
        if end == len(scores) or abs(scores[end] - scores[end - 1]) > tol:
            if end < len(scores) and set(a[start:end]) != set(b[start:end]):
                return False
            start = end
    return True


def loaded(root: Path) -> LoadedVersion:
    return LoadedVersion(artifact.current_version_dir(root))


@pytest.mark.parametrize("layout", ["file", "directory", "parquet"])
def test_ray_build_equals_local_build(tmp_path: Path, ray_address: str, layout: str) -> None:
    rows = records_with_gaps(600)
    if layout == "file":
        records = write_jsonl(tmp_path / "r.jsonl", rows)
    elif layout == "directory":
        records = tmp_path / "shards"
        records.mkdir()
        for k, start in enumerate((0, 150, 420)):
            end = {0: 150, 150: 420, 420: 600}[start]
            write_jsonl(records / f"part-{k}.jsonl", rows[start:end])
    else:
        records = tmp_path / "r.parquet"
        table = pa.table(
            {
                "id": [r["id"] for r in rows],
                "payload": [json.dumps(r["payload"]) for r in rows],
                **{
                    m: pa.array([r.get(m) for r in rows], pa.list_(pa.float32(), d))
                    for m, d in DIMS.items()
                },
            }
        )
        pq.write_table(table, records, row_group_size=128)
    model = make_model_dir(tmp_path / "m")
    fields = ("--filter-fields", "group,symbol")
    assert index_build(model, records, tmp_path / "local", *fields) == 0
    assert ray_build(model, records, tmp_path / "ray", *fields) == 0
    local, by_ray = loaded(tmp_path / "local"), loaded(tmp_path / "ray")
    assert_same_version(local, by_ray)
    assert local.manifest["engine"] == {"name": "local"}
    assert by_ray.manifest["engine"]["name"] == "ray"


def test_ray_compact_build_equals_local_compact_build(tmp_path: Path, ray_address: str) -> None:
    """--compact is the publish's business, after either engine wrote the rows."""
    records = write_jsonl(tmp_path / "r.jsonl", records_with_gaps(300))
    model = make_model_dir(tmp_path / "m")
    assert index_build(model, records, tmp_path / "local", "--compact") == 0
    assert ray_build(model, records, tmp_path / "ray", "--compact") == 0
    local, by_ray = loaded(tmp_path / "local"), loaded(tmp_path / "ray")
    assert_same_version(local, by_ray)
    assert by_ray.manifest["compact"] == local.manifest["compact"]
    assert all(e.dtype == np.float16 for e in by_ray.stored.embeddings.values())


def test_small_blocks_and_duplicates_across_shards(tmp_path: Path, ray_address: str) -> None:
    """Blocks of 16 records: a duplicate id lands in another shard than its first occurrence,
    and a bad record's id is taken by a later one."""
    rows = records_with_gaps(200, seed=1)
    rows[150]["id"] = rows[3]["id"]  # duplicate, 9 blocks later
    rows[40]["a"] = [1.0]  # bad ...
    rows[170]["id"] = rows[40]["id"]  # ... so its id is free for this one
    rows[180]["id"] = rows[40]["id"]  # and this one is then a duplicate
    rows[120]["smell"] = "x"
    rows[120]["id"] = rows[7]["id"]  # bad and a duplicate: named as a duplicate
    write_jsonl(tmp_path / "r.jsonl", rows)
    model = make_model_dir(tmp_path / "m")
    results = {}
    for engine in ("local", "ray"):
        opts = JobOptions(skip_bad=True, progress=False, engine=engine, chunk_rows=16)
        results[engine] = build(model, tmp_path / "r.jsonl", tmp_path / engine, opts)
    rejected = results["ray"].manifest["rejected"]
    assert rejected == results["local"].manifest["rejected"]
    assert [(r["line"], r["reason"][:14]) for r in rejected] == [
        (41, "a: vector must"),
        (121, "duplicate id, "),
        (151, "duplicate id, "),
        (181, "duplicate id, "),
    ]
    assert rejected[3]["reason"] == "duplicate id, first seen on line 171"
    assert_same_version(loaded(tmp_path / "local"), loaded(tmp_path / "ray"))


def test_bad_records_are_named_as_the_local_engine_names_them(
    tmp_path: Path, ray_address: str, capsys
) -> None:
    lines = [json.dumps(good(i)) for i in range(3)]
    for k, (mutate, _) in enumerate(CASES):
        row = good(10 + k)
        mutate(row)
        lines += [json.dumps(row), json.dumps(good(100 + k))]
    for k, (mutate, _) in enumerate(RAW_CASES):
        lines += [mutate(json.dumps(good(2))).replace('"g2"', f'"raw{k}"'), ""]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    model = mm_model_dir(tmp_path / "m")
    # without --skip-bad: the first bad line stops both, with the same message
    assert index_build(model, tmp_path / "r.jsonl", tmp_path / "local") == 2
    local_err = capsys.readouterr().err
    assert ray_build(model, tmp_path / "r.jsonl", tmp_path / "ray") == 2
    assert capsys.readouterr().err == local_err
    assert "line 4, id 'g1': duplicate id, first seen on line 2" in local_err
    assert artifact.read_current(tmp_path / "ray") is None
    assert not any((tmp_path / "ray" / artifact.STAGING).iterdir())
    # with it: the same records left out, the same list of them
    assert index_build(model, tmp_path / "r.jsonl", tmp_path / "local", "--skip-bad") == 0
    local_out = capsys.readouterr().out
    assert ray_build(model, tmp_path / "r.jsonl", tmp_path / "ray", "--skip-bad") == 0
    ray_out = capsys.readouterr().out
    rejected = [x for x in local_out.splitlines() if x.startswith("  rejected")]
    assert len(rejected) == len(CASES) + len(RAW_CASES)
    assert rejected == [x for x in ray_out.splitlines() if x.startswith("  rejected")]
    assert_same_version(loaded(tmp_path / "local"), loaded(tmp_path / "ray"))


def test_the_media_root_reaches_the_encoding_actors(
    tmp_path: Path, ray_address: str, capsys
) -> None:
    """The actors check media paths as the local engine does: inside --media-root, no further."""
    from tests.models.test_inputs import png_bytes

    (tmp_path / "recs").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret.png").write_bytes(png_bytes())
    rows = [good(i) for i in range(4)]
    rows[2]["image"] = "../outside/secret.png"  # inside the root --media-root widens
    rows[3]["image"] = "/etc/passwd"  # outside it
    path = write_jsonl(tmp_path / "recs/r.jsonl", rows)
    root = tmp_path / "root"
    model = mm_model_dir(tmp_path / "m")
    assert ray_build(model, path, root, "--media-root", tmp_path, "--skip-bad") == 0
    out = capsys.readouterr().out
    assert "rejected line 4, id 'g3': image: image file /etc/passwd is outside the media " in out
    assert loaded(root).manifest["counts"]["records"] == 3


def test_ray_update_equals_local_update(tmp_path: Path, ray_address: str, capsys) -> None:
    base = records_with_gaps(300)
    changed = vector_records(40, DIMS, seed=7, k=40)  # replacements of r-00000..r-00039
    new = [dict(r, id=f"new-{i}") for i, r in enumerate(vector_records(25, DIMS, seed=8))]
    changed[3]["a"] = [1.0]  # an invalid upsert of an existing id: the old record stays
    write_jsonl(tmp_path / "base.jsonl", base)
    write_jsonl(tmp_path / "up.jsonl", changed + new)
    (tmp_path / "del.txt").write_text("r-00100\nr-00101\nnever-existed\n")
    model = make_model_dir(tmp_path / "m")
    for engine in ("local", "ray"):
        root = tmp_path / engine
        assert index_build(model, tmp_path / "base.jsonl", root, "--filter-fields", "group") == 0
        args = ["index", "update", "--root", root, "--upsert", tmp_path / "up.jsonl"]
        args += ["--delete", tmp_path / "del.txt", "--quiet", "--engine", engine]
        assert run_cli(*args) == 2  # the invalid upsert stops it ...
        assert "line 4, id 'r-00003': a: vector must have length 6" in capsys.readouterr().err
        assert run_cli(*args, "--skip-bad") == 0  # ... or is left out
    local, by_ray = loaded(tmp_path / "local"), loaded(tmp_path / "ray")
    assert_same_version(local, by_ray)
    assert local.manifest["update"] == by_ray.manifest["update"]
    assert local.manifest["update"]["encoded"] == 64
    row = by_ray.records.row_of("r-00003")
    assert row is not None and by_ray.records[row]["payload"] == base[3]["payload"]


@pytest.mark.parametrize("ray_of", ["cluster", "driver"])
def test_sigkill_of_the_ray_driver_leaves_the_published_version(
    tmp_path: Path, ray_address: str, ray_of: str
) -> None:
    """Killed while actors write shards: on a cluster (its actors die with the job), or with
    the local Ray that the driver started (which dies with it)."""
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "small.jsonl", vector_records(50, DIMS))
    (tmp_path / "big").mkdir()
    for k in range(8):
        write_jsonl(tmp_path / "big" / f"{k}.jsonl", vector_records(4000, DIMS, seed=k + 1))
    for k in range(8):  # ids unique across the shards
        path = tmp_path / "big" / f"{k}.jsonl"
        path.write_text(path.read_text().replace('"id": "r-', f'"id": "s{k}-'))
    root = tmp_path / "root"
    assert index_build(model, tmp_path / "small.jsonl", root) == 0
    published = artifact.read_current(root)
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model)]
    cmd += ["--records", str(tmp_path / "big"), "--root", str(root), "--quiet"]
    cmd += ["--engine", "ray", "--workers", "2", "--batch-size", "32"]
    if ray_of == "cluster":
        cmd += ["--ray-address", ray_address]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    shards: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None and not shards:
        shards = list((root / artifact.STAGING).glob("*/shards/*.arrow"))
        time.sleep(0.05)
    assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()!r}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert shards, "never saw a shard written"
    deadline = time.monotonic() + 30
    while ray_processes_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes_of(proc.pid) == []  # no Ray of its own outlives the driver
    assert artifact.read_current(root) == published
    assert [v["version"] for v in artifact.list_versions(root)] == [published]
    assert verify(artifact.version_dir(root, published)) == []
    # the next run removes what the killed one left, and publishes
    assert ray_build(model, tmp_path / "small.jsonl", root) == 0
    assert list((root / artifact.STAGING).iterdir()) == []
    assert artifact.read_current(root) != published
    assert verify(artifact.current_version_dir(root)) == []


def ray_processes_of(pid: int) -> list[int]:
    """Processes of the Ray session that process `pid` started: Ray names its session
    directory after that pid (session_<date>_<time>_<pid>) and passes it to every process it
    starts but its workers, which exit with the raylet."""
    session = re.compile(rf"session_[0-9_-]+_{pid}\b".encode())
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and session.search((proc / "cmdline").read_bytes()):
                found.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile
    return found


def test_a_driver_starts_and_stops_its_own_local_ray(tmp_path: Path) -> None:
    """Without --ray-address, as a user runs it: a Ray of its own, stopped at the end."""
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", records_with_gaps(100))
    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model)]
    cmd += ["--records", str(tmp_path / "r.jsonl"), "--root", str(root)]
    cmd += ["--engine", "ray", "--workers", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "published version" in out
    assert "encode: " in err  # the progress bar, as the local engine shows it
    assert loaded(root).manifest["counts"]["records"] == 100
    deadline = time.monotonic() + 30
    while ray_processes_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes_of(proc.pid) == []


def test_ray_client_address(tmp_path: Path, ray_address: str) -> None:
    """ray://: the driver is no node of the cluster, and Ray Data runs in a task there for it.
    The cluster is one that `ray start --head` runs, with its Ray Client server."""
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", records_with_gaps(300))
    assert index_build(model, tmp_path / "r.jsonl", tmp_path / "local") == 0
    gcs, client = free_port(), free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block"]
    cmd += [f"--port={gcs}", f"--ray-client-server-port={client}", "--num-cpus=2"]
    cmd += [f"--dashboard-agent-listen-port={free_port()}", "--include-dashboard=false"]
    cmd += ["--disable-usage-stats"]
    # RAY_AUTH_MODE=token, from this module's Ray: the head and the client use its token.
    # The head starts a server per client and waits 30 s for it by default: on a loaded
    # machine that start can take longer.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S"] = "180"
    with open(tmp_path / "head.log", "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        build = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model)]
        build += ["--records", str(tmp_path / "r.jsonl"), "--root", str(tmp_path / "client")]
        build += ["--engine", "ray", "--ray-address", f"ray://127.0.0.1:{client}"]
        build += ["--workers", "2"]
        deadline = time.monotonic() + 120
        while True:  # until the head's client server listens
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", client)) == 0:
                    break
            assert time.monotonic() < deadline and head.poll() is None, "no Ray head"
            time.sleep(0.5)
        # The head's start of a server for this client can fail on its side; the build tries
        # again itself (indexer.build.ray_engine.connect)
        done = subprocess.run(build, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        head.terminate()  # `ray start --block` stops the processes it started
        head.wait(timeout=60)
        # `ray start` records its cluster for a plain ray.init() on this machine to join:
        # forget this one, now gone
        recorded = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if recorded.read_text().strip().endswith(f":{gcs}"):
                recorded.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "encode: " in done.stderr
    assert_same_version(loaded(tmp_path / "local"), loaded(tmp_path / "client"))


@pytest.mark.parametrize(
    ("address", "failures", "calls", "raised"),
    [
        ("ray://head:10001", 2, 3, False),  # the third start of a client server works
        ("ray://head:10001", 3, 3, True),  # three failures: the job's
        ("auto", 1, 1, True),  # not Ray Client: no second try
        ("10.0.0.7:6379", 1, 1, True),  # nor a GCS address (its reachability: tested below)
    ],
)
def test_a_ray_client_connection_is_tried_again_when_the_server_fails_to_start(
    monkeypatch, address: str, failures: int, calls: int, raised: bool
) -> None:
    # A stand-in for ray.init: the head's failure to start a client server (ray-project/ray
    # #63202) happens at random on a real cluster and cannot be provoked.
    from indexer.build import ray_engine

    tried: list[str] = []

    def init(address: str, **kwargs: object) -> None:
        tried.append(address)
        if len(tried) <= failures:
            raise ConnectionAbortedError("Initialization failure from server:\nZombieProcess")

    monkeypatch.setattr(ray_engine.ray, "init", init)
    monkeypatch.setattr(ray_engine.ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_engine, "CLIENT_RETRY_S", 0.0)
    monkeypatch.setattr(ray_engine, "check_reachable", lambda address: None)
    if raised:
        with pytest.raises(ClusterError, match=f"--ray-address {address}: the cluster did not"):
            ray_engine.connect(address, {})
    else:
        ray_engine.connect(address, {})
    assert tried == [address] * calls


def test_an_address_that_takes_no_connection_is_named_at_once(tmp_path: Path) -> None:
    # In a child: this module's Ray, once started, would stand in for any address given.
    model = make_model_dir(tmp_path / "m")
    write_jsonl(tmp_path / "r.jsonl", records_with_gaps(10))
    closed = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for address in (f"127.0.0.1:{closed}", f"ray://127.0.0.1:{closed}"):
        build = [sys.executable, "-m", "app.cli", "index", "build", "--model", str(model)]
        build += ["--records", str(tmp_path / "r.jsonl"), "--root", str(tmp_path / "root")]
        build += ["--engine", "ray", "--ray-address", address]
        t0 = time.monotonic()
        done = subprocess.run(build, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"--ray-address {address}: no Ray cluster answers at 127.0.0.1:{closed}" in (
            done.stderr
        )
        assert "Traceback" not in done.stderr
        assert time.monotonic() - t0 < 60  # not Ray's minutes of reconnecting
    assert not (tmp_path / "root" / artifact.CURRENT).exists()
    with socket.socket() as listening:  # an address that answers passes the check
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable(f"ray://127.0.0.1:{listening.getsockname()[1]}")


def test_the_addresses_ray_resolves_itself_are_not_checked() -> None:
    assert host_port("auto") is None and host_port("local") is None and host_port("h") is None
    assert host_port("ray://head:10001") == ("head", 10001)
    assert host_port("[::1]:6379") == ("::1", 6379)
    check_reachable("auto")  # no connection tried
