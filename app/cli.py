"""The `hclip` console script: one entry point dispatching to each package's commands.

It lives in `app`, the top of the import chain (models <- indexer <- app), and imports each
command's module only when that command runs, so `hclip train` never loads FastAPI or FAISS.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import sys
from collections.abc import Sequence

from app.core.logs import configure_logging

COMMANDS = ("train", "index", "serve", "demo", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or, given a command word, one with that command alone: each
    command's module is imported to declare its options, and `hclip index` needs neither the
    service's settings (pydantic) nor the demo's imports."""
    p = argparse.ArgumentParser(
        prog="hclip", description="Hadamard-CLIP training, indexing and search"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    wanted = COMMANDS if command is None else (command,)

    if "train" in wanted:
        from models.train import cli as train_cli

        train = sub.add_parser("train", help="train a model from a JSON config")
        train_cli.add_arguments(train)
        train.set_defaults(func=lambda a: train_cli.run(a))

    if "index" in wanted:
        from indexer import cli as index_cli

        index = sub.add_parser("index", help="build, update and maintain versioned indexes")
        index_cli.add_arguments(index)

    if "serve" in wanted:
        from app.server import serve as serve_cli

        serve = sub.add_parser("serve", help="serve the published index over HTTP")
        serve_cli.add_arguments(serve)
        serve.set_defaults(func=serve_cli.run)

    if "demo" in wanted:
        from app.demo import cli as demo_cli

        demo = sub.add_parser("demo", help="digits shown, spoken and written: build, then serve")
        demo_cli.add_arguments(demo)
        demo.set_defaults(func=demo_cli.run)

    if "bench" in wanted:
        from benchmarks import expressivity as bench_expressivity

        bench = sub.add_parser("bench", help="benchmarks")
        bench_sub = bench.add_subparsers(dest="bench", required=True)
        expr = bench_sub.add_parser(
            "expressivity", help="H-CLIP vs sum-of-pairs on 3-way interactions"
        )
        bench_expressivity.add_arguments(expr)
        expr.set_defaults(func=bench_expressivity.main_args)
    return p


SERVING_COMMANDS = ("serve", "demo")


def _command(argv: Sequence[str]) -> str | None:
    """The command word (`index`, `serve`...): the first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command(argv) in SERVING_COMMANDS:
        # Idle OpenMP threads must sleep, not spin, while the other core serves HTTP. libgomp
        # reads this once, when torch loads it, so it is set before anything imports torch.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from app.demo.data import DemoError
    from indexer.cli import USER_ERRORS as INDEX_ERRORS
    from models.extras import ExtraMissing
    from models.limits import InputError
    from models.train.cli import USER_ERRORS

    # The command first (as typed nearly always): its parser alone. Otherwise (an option
    # first, no command, a misspelt one) the whole parser, whose help and errors list them all.
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args))
    except (*USER_ERRORS, *INDEX_ERRORS, InputError, DemoError, ExtraMissing) as exc:
        print(f"hclip {args.command}: error: {exc}", file=sys.stderr)
        return 2


# Commands whose work is complete and durable when main() returns (an index version is fsynced
# before CURRENT moves), so the process may leave without tearing the interpreter down.
QUICK_EXIT_COMMANDS = ("index",)


def stdout_gone() -> bool:
    """Whether stdout is a pipe that nobody reads any more (poll reports an error on the
    write end of a pipe whose read end is closed)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real file, or no poll here
        return False


def run() -> None:
    """The console script (and `python -m app.cli`): main(), then the exit.

    Tearing down an interpreter that has loaded torch (module teardown, torch's destructors)
    takes a noticeable part of a second. So after an index command, once stdout, stderr and
    the log handlers are flushed, the process leaves at once (os._exit), unless Ray was
    loaded: its clean-up at exit must run. An error that escapes main() takes the normal path,
    with its traceback."""
    argv = sys.argv[1:]
    try:
        code = main(argv)
    except BrokenPipeError:
        if not stdout_gone():
            raise  # another pipe broke: a fault, with its traceback
        # Whoever read the output left (`hclip index list | head -1`): what was asked is done,
        # only the printing failed. Leave quietly, as a tool killed by SIGPIPE would, and keep
        # the interpreter's last flush of stdout from failing again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    if _command(argv) in QUICK_EXIT_COMMANDS and "ray" not in sys.modules:
        logging.shutdown()
        with contextlib.suppress(BrokenPipeError):  # a reader that left wants nothing more
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
