"""The OpenAPI document is the contract: schemathesis (its CLI, `st run`) generates thousands of
requests from /openapi.json, valid and invalid, against a real server, and checks every
response with all its checks: no 5xx, documented statuses, content types and headers, responses
that fit their schemas, invalid requests refused, valid ones accepted.

One check is disabled for the server with media modalities, for this reason:
- positive_data_acceptance: a schema can say that an image or a clip is a base64 data: URI, but
  not that its bytes decode as a PNG or a WAV; such requests are refused with a documented 422.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.conftest import build_index, running, settings_for
from tests.app.test_filters_and_batch import rows_with_fields
from tests.app.test_hostile import GOOD, media_model


def st() -> list[str]:
    exe = shutil.which("st", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("schemathesis is not installed (it is in the dev extra)")
    return [exe]


def run_schemathesis(url: str, examples: int, exclude: list[str]) -> str:
    cmd = [*st(), "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", str(examples)]
    cmd += ["--seed", "1", "-H", "Authorization: Bearer t0k3n", "--workers", "1"]
    cmd += [arg for check in exclude for arg in ("--exclude-checks", check)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    return r.stdout


def generated(out: str) -> int:
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m is not None, out[-2000:]
    assert m.group(1) == m.group(2)
    return int(m.group(1))


def test_vector_model_with_filters(tmp_path: Path, vector_index) -> None:
    _, model_dir, _ = vector_index
    root = tmp_path / "root"
    build_index(root, model_dir, rows_with_fields(200), tmp_path, "--filter-fields",
                "category,year,flag")  # fmt: skip
    with running(settings_for(root, admin_token="t0k3n")) as client:
        out = run_schemathesis(str(client.base_url), 150, exclude=[])
    assert generated(out) >= 2000


def test_media_text_and_vector_model(tmp_path: Path) -> None:
    root = tmp_path / "root"
    rows = [
        {"id": f"g{i}", "image": GOOD["image"](i), "audio": GOOD["audio"](i),
         "text": f"number {i}", "vec": [i, 1, 2]}
        for i in range(12)
    ]  # fmt: skip
    build_index(root, media_model(tmp_path), rows, tmp_path)
    with running(settings_for(root, admin_token="t0k3n")) as client:
        out = run_schemathesis(str(client.base_url), 60, exclude=["positive_data_acceptance"])
    assert generated(out) >= 800
