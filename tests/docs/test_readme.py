"""The README's own-data example, run from the README's text as a user would paste it: train,
build, serve, search with curl and with the Python client."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.app.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- own-data example -->"


def own_data_example() -> str:
    text = (REPO / "README.md").read_text()
    found = re.search(re.escape(MARK) + r"\n```bash\n(.*?)\n```", text, re.S)
    assert found, f"README.md has no bash block after {MARK}"
    return found.group(1)


def test_the_readme_example_trains_indexes_serves_and_searches(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PORT": str(free_port()),
        # the hclip and python3 of this environment, as after the README's install command
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    env.pop("HCLIP_ROOT", None)
    done = subprocess.run(
        ["bash", "-e", "-c", own_data_example()],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    by_curl = json.loads(next(line for line in lines if line.startswith("{")))
    assert by_curl["view"] == "caption+photo" and len(by_curl["results"]) == 3
    assert all(r["payload"]["year"] >= 2020 for r in by_curl["results"])  # the filter held
    assert by_curl["results"][0]["payload"]["topic"] == 0  # doc-0's topic, among other records
    view, hits = lines[-1].split(" ", 1)
    assert view == "sound"
    topics = [topic for _, topic in ast.literal_eval(hits)]
    assert topics.count(0) >= 4, hits  # the records of doc-0's topic come first
    assert (tmp_path / "my-hclip" / "index" / "CURRENT").is_file()
