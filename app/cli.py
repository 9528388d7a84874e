"""The `hclip` console script: one entry point dispatching to each package's commands.

It lives in `app`, the top of the import chain (models <- indexer <- app), and imports each
command's module only when that command runs, so `hclip train` never loads FastAPI or FAISS.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path

from app.core.logs import configure_logging

COMMANDS = {
    "train": "train a model from a JSON config",
    "eval": "retrieval figures of a model on held-out records, exact or through an index",
    "index": "build, update and maintain versioned indexes",
    "serve": "serve the published index over HTTP",
    "demo": "digits shown, spoken and written: build, then serve",
    "bench": "benchmarks",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Given a command word, a parser with that command and its options (its module imported
    to declare them, and nothing heavier: the jobs import torch when they run); without one,
    a parser that lists the commands, for help and misspellings, importing none of them."""
    p = argparse.ArgumentParser(
        prog="hclip", description="Hadamard-CLIP training, indexing and search"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    if command not in COMMANDS:
        for name, text in COMMANDS.items():
            sub.add_parser(name, help=text, add_help=False)
        return p
    wanted = (command,)

    if "train" in wanted:
        from models.train import cli as train_cli

        train = sub.add_parser("train", help=COMMANDS["train"])
        train_cli.add_arguments(train)
        train.set_defaults(func=lambda a: train_cli.run(a))

    if "eval" in wanted:
        from indexer import evaluate as eval_cli

        evaluate = sub.add_parser("eval", help=COMMANDS["eval"])
        eval_cli.add_arguments(evaluate)
        evaluate.set_defaults(func=eval_cli.run)

    if "index" in wanted:
        from indexer import cli as index_cli

        index = sub.add_parser("index", help=COMMANDS["index"])
        index_cli.add_arguments(index)

    if "serve" in wanted:
        from app.server import serve as serve_cli

        serve = sub.add_parser("serve", help=COMMANDS["serve"])
        serve_cli.add_arguments(serve)
        serve.set_defaults(func=serve_cli.run)

    if "demo" in wanted:
        from app.demo import cli as demo_cli

        demo = sub.add_parser("demo", help=COMMANDS["demo"])
        demo_cli.add_arguments(demo)
        demo.set_defaults(func=demo_cli.run)

    if "bench" in wanted:
        from benchmarks import expressivity as bench_expressivity

        bench = sub.add_parser("bench", help=COMMANDS["bench"])
        bench_sub = bench.add_subparsers(dest="bench", required=True)
        expr = bench_sub.add_parser(
            "expressivity", help="H-CLIP vs sum-of-pairs on 3-way interactions"
        )
        bench_expressivity.add_arguments(expr)
        expr.set_defaults(func=bench_expressivity.main_args)
    return p


SERVING_COMMANDS = ("serve", "demo")
# busy-wait iterations before an idle OpenMP thread sleeps: about a millisecond by libgomp's own
# estimate; with the passive policy, libgomp spins none once its threads outnumber the cores
SPIN_BEFORE_SLEEP = "100000"
# What a serving command sets, where the environment does not, before anything imports torch
# (libgomp reads both OpenMP settings once, when torch loads it):
# - idle OpenMP threads sleep, not spin, while another worker needs the core; but a forward's
#   threads spin briefly between its parallel regions (microseconds apart), or each region
#   waits for a sleeping thread to wake (docs/benchmarks/tower_serving.md);
# - tokenizers' Rayon pool (a thread per core in every worker) spins in sched_yield after each
#   batch, taking cores from the towers (same document): a query batch's sentences are
#   tokenised in the encode thread instead.
SERVING_ENVIRONMENT = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "GOMP_SPINCOUNT": SPIN_BEFORE_SLEEP,
    "TOKENIZERS_PARALLELISM": "false",
}


def _command(argv: Sequence[str]) -> str | None:
    """The command word (`index`, `serve`...): the first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command(argv) in SERVING_COMMANDS:
        for name, value in SERVING_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    args = build_parser(_command(argv)).parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    # The job named in every error: `hclip index build`, not `hclip index`.
    doing = " ".join(["hclip", args.command, *filter(None, [getattr(args, "index_command", None)])])
    try:
        return int(args.func(args))
    except Exception as exc:
        if isinstance(exc, user_errors()):
            print(f"{doing}: error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError) and exc.errno in FILESYSTEM_ERRNOS and exc.filename:
            from indexer.store.artifact import storage_error  # light: no torch

            print(f"{doing}: error: {storage_error(exc, 'stopped', Path(exc.filename))}",
                  file=sys.stderr)  # fmt: skip
            return 1
        raise


# A filesystem's refusals (full, read-only, gone, forbidden): the user's to fix, in one line.
FILESYSTEM_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM,
    errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
}  # fmt: skip


def user_errors() -> tuple[type[Exception], ...]:
    """A user's mistakes, told apart from bugs: one line on stderr and exit status 2 (the
    modules are light; the command that raised one has imported them anyway)."""
    from app.api.auth import KeyFileError
    from app.demo.data import DemoError
    from indexer.cli import USER_ERRORS as INDEX_ERRORS
    from indexer.evaluate import EvalError
    from models.extras import ExtraMissing
    from models.limits import InputError
    from models.train.cli import USER_ERRORS

    return (
        *USER_ERRORS,
        *INDEX_ERRORS,
        EvalError,
        InputError,
        DemoError,
        ExtraMissing,
        KeyFileError,
    )


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
