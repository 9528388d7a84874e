"""The containers' commands, run as local processes with the same environment: a Redis, an
indexer job that publishes a version, the api serving it, and a second indexer job whose new
version the api picks up without a restart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.app.conftest import free_port, private_redis, wait_until
from tests.conftest import DIMS, make_model_dir, vector_records, write_jsonl
from tests.deploy.dockerfiles import compose, env_file, stages

BIN = Path(sys.executable).parent


def local(value: str, dirs: dict[str, str]) -> str:
    """A container path or URL (`redis://redis:6379`) as it is on this machine."""
    for container, here in dirs.items():
        value = value.replace(container, here)
    return value


def container_env(service: str, stage: str, dirs: dict[str, str], port: int) -> dict[str, str]:
    spec = compose()["services"][service]
    env = dict(stages()[stage].env)
    for name in spec.get("env_file", []):
        env |= env_file(name)
    env |= {k: str(v) for k, v in spec.get("environment", {}).items()}
    env = {k: local(v, dirs) for k, v in env.items() if k != "PATH"}
    env["HCLIP_HOST"] = "127.0.0.1"  # loopback only on a shared test machine
    env["HCLIP_PORT"] = str(port)
    return {**os.environ, **env}


def command(stage: str, args: list[str], dirs: dict[str, str]) -> list[str]:
    argv = stages()[stage].entrypoint + args
    return [str(BIN / argv[0])] + [local(a, dirs) for a in argv[1:]]


def versions_served(url: str) -> set[str]:
    """The versions the api's workers serve now, from /metrics (one series per worker)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    series = re.compile(r'^hclip_index_version_info\{.*version="([^"]+)".*\} 1\.0$', re.M)
    return set(series.findall(text))


def test_indexer_then_api_then_reindex(tmp_path: Path) -> None:
    redis_port, api_port = free_port(), free_port()
    # a URL is no path: Path() would fold its "//" (a Redis client that accepted the folded
    # URL went to the machine's Redis on 6379; redis-py 8.2 refuses it)
    dirs = {
        "/data/index": str(tmp_path / "index"),
        "/data/models": str(tmp_path / "models"),
        "/data/records": str(tmp_path / "records"),
        "redis://redis:6379": f"redis://127.0.0.1:{redis_port}",
    }
    for d in ("index", "models", "records"):
        (tmp_path / d).mkdir()
    make_model_dir(tmp_path / "models" / "current")
    first = vector_records(200, DIMS, seed=0)
    write_jsonl(tmp_path / "records" / "records.jsonl", first)

    indexer = compose()["services"]["indexer"]
    with private_redis(redis_port):
        job = command("indexer", indexer["command"], dirs)
        subprocess.run(
            job,
            check=True,
            env=container_env("indexer", "indexer", dirs, api_port),
            stdout=subprocess.DEVNULL,
        )
        v1 = (tmp_path / "index" / "CURRENT").read_text().strip()

        api_stage = stages()["api"]
        api = subprocess.Popen(
            command("api", api_stage.cmd, dirs),
            env=container_env("api", "api", dirs, api_port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{api_port}"
        try:

            def ready() -> bool:
                try:
                    return httpx.get(url + "/readyz", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, timeout=60)
            # the image's HEALTHCHECK command passes against the running api
            health = stages()["api"].healthcheck
            env = container_env("api", "api", dirs, api_port)
            assert subprocess.run([sys.executable, *health[1:]], env=env).returncode == 0

            body = {"query": {"a": first[0]["a"]}, "k": 3}
            r = httpx.post(url + "/v1/search", json=body, timeout=10).json()
            assert r["index_version"] == v1 and len(r["results"]) == 3
            assert {x["id"] for x in r["results"]} <= {rec["id"] for rec in first}
            assert httpx.get(url + "/v1/records/new-5").status_code == 404
            assert httpx.post(url + "/v1/search", json=body, timeout=10).json()["cached"] is True

            # a second job: an incremental update, as `docker compose run indexer update ...`
            new = [
                dict(rec, id=f"new-{i}") for i, rec in enumerate(vector_records(20, DIMS, seed=3))
            ]
            write_jsonl(tmp_path / "records" / "new.jsonl", new)
            update = [
                "update",
                "--root",
                "/data/index",
                "--upsert",
                "/data/records/new.jsonl",
                "--quiet",
            ]
            subprocess.run(
                command("indexer", update, dirs),
                check=True,
                stdout=subprocess.DEVNULL,
                env=container_env("indexer", "indexer", dirs, api_port),
            )
            v2 = (tmp_path / "index" / "CURRENT").read_text().strip()
            assert v2 != v1
            # every worker polls CURRENT on its own: /readyz answers for one of them
            wait_until(lambda: versions_served(url) == {v2}, timeout=30)
            assert api.poll() is None  # same process: no restart
            rec = httpx.get(url + "/v1/records/new-5").json()
            assert rec["index_version"] == v2 and rec["id"] == "new-5"
            r = httpx.post(url + "/v1/search", json=body, timeout=10).json()
            assert r["index_version"] == v2 and r["cached"] is False  # not v1's cached answer
        finally:
            api.terminate()
            api.wait(10)
