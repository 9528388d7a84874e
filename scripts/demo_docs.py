"""Refresh docs/demo/: the demo's results table and plot, and a screenshot of its search page.

    python scripts/demo_docs.py [--data-dir .hclip-demo] [--port 8123]

Runs `hclip demo` (which reuses what it built before), searches with the first example image
and clip in headless Chromium, and copies the figures into docs/demo/.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.app.browser import search_with_examples  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", type=Path, default=REPO / ".hclip-demo")
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args()
    out = REPO / "docs" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "demo",
            "--quiet",
            "--port",
            str(args.port),
            "--data-dir",
            str(args.data_dir),
        ],
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{args.port}/"
    try:
        for _ in range(3600):
            try:
                if httpx.get(url + "readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("hclip demo exited")
            time.sleep(0.5)
        # an image of 3 and a spoken "four": the interaction's answer is seven
        texts = search_with_examples(url, out / "page.png", {"image": 3, "audio": 4})
        print("\n---\n".join(texts[:3]))
    finally:
        server.terminate()
        server.wait(10)
    for name in ("results.md", "results.png", "results.json"):
        shutil.copy(args.data_dir / name, out / name)
    print(f"docs refreshed in {out}")


if __name__ == "__main__":
    main()
