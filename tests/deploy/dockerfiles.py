"""Reading what the containers would run from docker/Dockerfile and docker-compose.yml."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"


@dataclass
class Stage:
    name: str
    parent: str
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    lines, buf = [], ""
    for raw in text.splitlines():
        if raw.strip().startswith("#") and not buf:
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append((buf + raw).strip())
        buf = ""
    return [line for line in lines if line]


def stages() -> dict[str, Stage]:
    out: dict[str, Stage] = {}
    current: Stage | None = None
    for line in _logical_lines(DOCKERFILE.read_text()):
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert m, line
            parent = out.get(m.group(1))
            current = Stage(m.group(2), m.group(1))
            if parent:  # a stage inherits its parent stage's settings
                current.env = dict(parent.env)
                current.entrypoint, current.cmd = list(parent.entrypoint), list(parent.cmd)
                current.healthcheck = list(parent.healthcheck)
            out[current.name] = current
        elif current is None:
            continue
        elif op == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                current.env[key] = value
        elif op == "ENTRYPOINT":
            current.entrypoint = json.loads(rest)
        elif op == "CMD":
            current.cmd = json.loads(rest)
        elif op == "HEALTHCHECK":
            current.healthcheck = json.loads(rest[rest.index("CMD") + 3 :].strip())
    return out


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def env_file(name: str) -> dict[str, str]:
    env = {}
    for line in (REPO / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env
