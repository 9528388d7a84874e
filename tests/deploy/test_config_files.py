"""What can be checked without a Docker engine: lint, compose validation, the promised shape."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.deploy.dockerfiles import COMPOSE, DOCKERFILE, REPO, compose, stages


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    return path


def test_dockerfile_passes_hadolint() -> None:
    r = subprocess.run([_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_file_is_valid() -> None:
    r = subprocess.run(
        [_tool("docker-compose"), "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_broken_compose_file_is_caught(tmp_path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: whenever"))
    r = subprocess.run(
        [_tool("docker-compose"), "-f", str(bad), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode != 0


def test_images_are_slim_non_root_and_healthchecked() -> None:
    s = stages()
    assert s["build"].parent == "python:3.11-slim" and s["runtime"].parent == "python:3.11-slim"
    text = DOCKERFILE.read_text()
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert "USER 10001" in text
    assert s["api"].entrypoint + s["api"].cmd == ["hclip", "serve"]
    assert s["api"].healthcheck and "/healthz" in " ".join(s["api"].healthcheck)
    assert s["indexer"].entrypoint == ["hclip", "index"]
    runtime_part = text[text.index("AS runtime") :]
    assert "apt-get" not in runtime_part and "gcc" not in runtime_part


def test_compose_services() -> None:
    services = compose()["services"]
    redis = services["redis"]
    assert "allkeys-lru" in redis["command"] and "--maxmemory" in redis["command"]
    assert redis["mem_limit"] and redis["healthcheck"]["test"][-1] == "ping"
    api = services["api"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert api["environment"]["HCLIP_REDIS_URL"].startswith("redis://redis")
    assert "ports" not in api and api["deploy"]["replicas"] >= 2  # behind the load balancer
    lb = services["lb"]
    assert len(lb["ports"]) == 1 and "./docker/haproxy.cfg" in lb["volumes"][0]
    assert any(v.startswith("index:/data/index") for v in api["volumes"])
    indexer = services["indexer"]
    assert indexer["profiles"] == ["indexer"] and indexer["command"][0] == "build"
    assert "index:/data/index" in indexer["volumes"]
    # the milvus profile: Milvus standalone on its etcd and MinIO, and a build into it
    milvus = services["milvus"]
    assert milvus["profiles"] == ["milvus"] and milvus["command"][-1] == "standalone"
    assert set(milvus["depends_on"]) == {"milvus-etcd", "milvus-minio"}
    job = services["indexer-milvus"]["command"]
    assert job[job.index("--backend") + 1] == "milvus"
    assert job[job.index("--milvus-uri") + 1] == "http://milvus:19530"
    assert api["build"]["args"]["EXTRAS"] == "${HCLIP_EXTRAS:-}"
