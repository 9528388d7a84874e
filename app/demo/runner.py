"""Both heads trained side by side: one process per head, one progress bar for all of them.

Each head's models form a chain (its interaction model starts from its shared model's encoders)
and the two chains are independent, so they run at once on two cores or more. The processes
are spawned, not forked: the parent has loaded torch, and a fork would inherit its thread
pools' state. A worker trains and evaluates every stage of its head and sends back the
held-out results; on the way it reports the steps it has done, which the parent turns into one
bar. Each worker has its own pipe (a multiprocessing Queue would leave a semaphore behind at
exit).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

from app.demo.data import DemoError
from app.demo.recipe import Recipe
from models.progress import Progress

log = logging.getLogger(__name__)


def quiet_model_loading() -> None:
    """No "Loading weights" bar each time a process loads MiniLM: the demo shows one bar of its
    own. transformers reads this when it is imported, which the demo leaves to MiniLM's load."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _worker(data: Path, recipe: Recipe, head: str, seed: int, out: Connection) -> None:
    try:
        logging.basicConfig(level=logging.WARNING)
        quiet_model_loading()
        # tqdm's default lock is a multiprocessing one, a named semaphore in a spawned process
        # that nothing unlinks: a thread lock does, as the worker's own bars are never shown.
        Progress.set_lock(threading.RLock())
        from app.demo.evaluate import evaluate
        from app.demo.train import train_stage
        from models.checkpoint import load_model

        results, seconds = {}, {}
        for stage in recipe.stages:
            t0 = time.perf_counter()
            path = train_stage(
                data, recipe, stage, head, seed, progress=False, report=lambda n: out.send(n)
            )
            t1 = time.perf_counter()
            results[stage.dataset] = evaluate(load_model(path), stage.dataset, data)
            seconds[stage.dataset] = {
                "train": round(t1 - t0, 1),
                "evaluate": round(time.perf_counter() - t1, 1),
            }
        out.send({"results": results, "seconds": seconds})
    except BaseException:
        out.send({"error": traceback.format_exc()})
    finally:
        out.close()


def run_heads(
    data: Path, recipe: Recipe, heads: tuple[str, ...], seed: int, progress: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Train and evaluate every head's stages, one process per head: (dataset -> head -> view
    -> metrics, head -> dataset -> seconds spent training and evaluating)."""
    ctx = mp.get_context("spawn")
    pipes = {h: ctx.Pipe(duplex=False) for h in heads}  # head -> (receiving end, sending end)
    procs = {
        h: ctx.Process(target=_worker, args=(data, recipe, h, seed, pipes[h][1]), daemon=True)
        for h in heads
    }
    total = len(heads) * sum(s.steps for s in recipe.stages)
    finished: dict[str, dict[str, Any]] = {}
    bar = Progress(
        total=total, desc=f"training {len(heads)} heads", unit="step", disable=not progress
    )
    try:
        for h, p in procs.items():
            p.start()
            pipes[h][1].close()  # the worker holds the sending end now
        waiting: dict[Connection, str] = {pipes[h][0]: h for h in heads}
        while waiting:
            for ready in wait(list(waiting)):
                conn = cast(Connection, ready)
                head = waiting[conn]
                try:
                    message: Any = conn.recv()
                except EOFError:
                    code = procs[head].exitcode
                    raise DemoError(f"training {head} died (exit code {code})") from None
                if isinstance(message, int):
                    bar.update(message)
                elif "error" in message:
                    raise DemoError(f"training {head} failed:\n{message['error']}")
                else:
                    finished[head] = message
                    del waiting[conn]
                    log.info("%s: seconds per stage %s", head, message["seconds"])
    finally:
        bar.close()
        for p in procs.values():
            if p.pid is None:
                continue  # never started
            if p.is_alive():
                p.terminate()
            p.join()
    datasets = [s.dataset for s in recipe.stages]
    by_dataset = {d: {h: finished[h]["results"][d] for h in heads} for d in datasets}
    return by_dataset, {h: finished[h]["seconds"] for h in heads}
