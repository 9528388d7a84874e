"""The `hclip` console script (app.cli): an index command leaves without tearing the
interpreter down, with all it printed and logged delivered and its exit code, while other
commands, and any run that loaded Ray, exit the usual way; a command typed first loads only its
own module; a reader that leaves early ends the command without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DIMS, index_build, make_model_dir, vector_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]
# The console script's body, with an exit handler that says whether the interpreter was torn
# down; `fake_ray` stands for a run that loaded Ray (its own clean-up must run).
SCRIPT = """
import atexit, sys, types
atexit.register(lambda: print("torn down", flush=True))
if sys.argv[1] == "fake_ray":
    sys.modules["ray"] = types.ModuleType("ray")
sys.argv = ["hclip", *sys.argv[2:]]
from app.cli import run
run()
"""


def hclip(*args: object, ray: bool = False) -> subprocess.CompletedProcess[str]:
    """The console script in a child, its output through pipes (block-buffered)."""
    argv = [sys.executable, "-c", SCRIPT, "fake_ray" if ray else "-", *map(str, args)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_an_index_build_delivers_its_output_and_leaves_at_once(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "model")
    records = write_jsonl(tmp_path / "r.jsonl", vector_records(200, DIMS))
    root = tmp_path / "root"
    done = hclip("index", "build", "--model", model, "--records", records, "--root", root)
    assert done.returncode == 0, done.stderr
    views = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("  view ")]
    assert sorted(views) == ["a", "a+b", "a+c", "b", "b+c", "c"]  # the last lines got out too
    assert "published version" in done.stderr  # the log, flushed
    assert "torn down" not in done.stdout
    bad = hclip(
        "index", "build", "--model", model, "--records", tmp_path / "none.jsonl", "--root", root
    )
    assert bad.returncode == 2
    assert "records file not found" in bad.stderr and "torn down" not in bad.stdout


@pytest.mark.parametrize(
    ("args", "ray"),
    [(["index", "list", "--root", "{root}"], True), (["train", "--help"], False)],
    ids=["with-ray-loaded", "not-an-index-command"],
)
def test_otherwise_the_interpreter_is_torn_down(tmp_path: Path, args: list[str], ray: bool) -> None:
    done = hclip(*(a.format(root=tmp_path) for a in args), ray=ray)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("torn down")


# What a command loaded, and its exit code: the console script's body, then a look at
# sys.modules (printed before the quick exit of an index command, from inside main's return).
LOADED = """
import sys
from app.cli import main
code = main(sys.argv[1:])
print("loaded:", " ".join(m for m in ("app.server.serve", "app.demo.cli", "indexer.cli")
                          if m in sys.modules))
print("code:", code)
"""


def loaded(*args: object) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", LOADED, *map(str, args)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_an_index_command_loads_neither_the_service_nor_the_demo(tmp_path: Path) -> None:
    done = loaded("index", "list", "--root", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "loaded: indexer.cli\n" in done.stdout and "code: 0" in done.stdout
    verbose = loaded("-v", "index", "list", "--root", tmp_path)  # an option first: the same
    assert "code: 0" in verbose.stdout
    assert "loaded: indexer.cli\n" in verbose.stdout


def test_help_and_a_misspelt_command_still_name_every_command() -> None:
    for args in (["--help"], ["idnex", "list"]):
        done = hclip(*args)
        shown = done.stdout + done.stderr
        assert all(c in shown for c in ("train", "index", "serve", "demo", "bench")), shown
    assert hclip("idnex").returncode == 2


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    records = write_jsonl(tmp_path / "r.jsonl", vector_records(20, DIMS))
    root = tmp_path / "root"
    assert index_build(make_model_dir(tmp_path / "model"), records, root) == 0
    argv = [sys.executable, "-c", SCRIPT, "-", "index", "list", "--root", str(root)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `hclip index list | head -0`: gone before the command prints
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_stdout_gone_tells_a_closed_reader_from_an_open_one() -> None:
    code = "from app.cli import stdout_gone; import sys, time; time.sleep(1); " + (
        "print(stdout_gone(), file=sys.stderr)"
    )
    for close_reader, want in ((False, "False"), (True, "True")):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stderr is not None
        if close_reader:
            proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        assert err.strip().endswith(want), err


HELP_IMPORTS = """
import sys
from app.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = [m for m in ("torch", "faiss", "fastapi") if m in sys.modules]
print("heavy:", " ".join(heavy) or "none")
"""


HELPS = [["--help"], ["index", "--help"], ["index", "build", "--help"], ["train", "--help"],
         ["serve", "--help"], ["nosuch"]]  # fmt: skip


@pytest.mark.parametrize("argv", HELPS)
def test_help_and_argument_errors_import_no_torch(argv: list[str]) -> None:
    """Help answers at once: the command line declares every option without loading torch,
    FAISS or FastAPI, which the commands import when they run."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS, *argv], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert "heavy: none" in done.stdout, done.stdout + done.stderr
    assert "usage: hclip" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("given", "policy", "spin", "tokenizers"),
    [
        ({}, "PASSIVE", "100000", "false"),
        (
            {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE", "TOKENIZERS_PARALLELISM": "true"},
            "ACTIVE", "0", "true",
        ),
    ],
)  # fmt: skip
def test_serving_sets_thread_waits_before_torch_loads_and_keeps_the_users(
    given: dict[str, str], policy: str, spin: str, tokenizers: str
) -> None:
    """`hclip serve`: idle OpenMP threads sleep after a short spin (libgomp reads both once, when
    torch loads), and tokenizers runs no Rayon pool of its own; values the user set are kept."""
    code = (
        "import os, sys\n"
        "from app.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "e = os.environ\n"
        "print(e['OMP_WAIT_POLICY'], e['GOMP_SPINCOUNT'], e['TOKENIZERS_PARALLELISM'],"
        " 'torch' in sys.modules)"
    )
    ours = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TOKENIZERS_PARALLELISM")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**env, **given, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-4:] == [policy, spin, tokenizers, "False"]
