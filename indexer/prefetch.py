"""Producing items ahead of their consumer, in a thread or in a child process.

The local engine reads and checks chunks while it encodes the previous ones. Checking JSON
Lines is Python code that holds the GIL, so a reader thread and the encoding thread take turns
on one core more than they share two (measured: the main process's CPU time per record fell by
a third with the child, and not with a thread); a child process has a GIL of its own. The child
is forked (it inherits the model and everything else; only the items it sends back are
pickled), and only from a process that runs no other Python thread: a fork copies one thread,
and a lock that another thread held stays locked in the child. Native threads that hold no
Python lock are fine: OpenMP's idle pool (torch's), which the child never uses, since checking
records runs no parallel torch operation. Otherwise, and where fork does not exist, a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def ahead(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    """The items of make()'s iterator, produced up to `depth` ahead; an error there is raised
    here, at the item where it happened; closing this generator stops the producer."""
    if "fork" in multiprocessing.get_all_start_methods() and forkable():
        return in_child(make, depth)
    return in_thread(make, depth)


def forkable() -> bool:
    """No Python thread but this one (a driver of Ray, for one, runs several)."""
    return threading.active_count() == 1


class _Done:
    pass


def in_thread(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    items: queue.Queue[T | BaseException | _Done] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: T | BaseException | _Done) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in make():
                if not put(item):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            put(exc)
            return
        put(_Done())

    thread = threading.Thread(target=produce, name="hclip-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if isinstance(item, _Done):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def in_child(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    """A forked child produces into a pipe: one item in the pipe and one being pickled, so
    `depth` is moot here; the pipe's own buffer is the bound."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_produce_into, args=(make, send, os.getpid()), name="hclip-reader", daemon=True
    )
    child.start()
    send.close()  # the child's end
    try:
        while True:
            if not receive.poll(POLL_S):
                if not child.is_alive() and not receive.poll(0):
                    raise RuntimeError(f"the reader process stopped (exit code {child.exitcode})")
                continue
            try:
                kind, item = pickle.loads(receive.recv_bytes())
            except EOFError:
                raise RuntimeError(
                    f"the reader process stopped (exit code {child.exitcode})"
                ) from None
            if kind == "done":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        if child.is_alive():
            child.kill()  # the consumer stopped early: nothing more is wanted
        child.join(timeout=5)
        receive.close()


def _produce_into(make: Callable[[], Iterator[Any]], send: Any, parent: int) -> None:
    _die_with(parent)
    _close_inherited(keep={0, 1, 2, send.fileno()})
    # Items cross as plain pickles: multiprocessing's own pickler would pass a torch tensor as
    # a handle to shared memory that this process must outlive, and it does not.
    try:
        for item in make():
            send.send_bytes(pickle.dumps(("item", item), pickle.HIGHEST_PROTOCOL))
        send.send_bytes(pickle.dumps(("done", None)))
    except BaseException as exc:  # handed to the consumer, which raises it
        send.send_bytes(pickle.dumps(("error", _picklable(exc))))
    send.close()


def _close_inherited(keep: set[int]) -> None:
    """The parent's open files are not the child's: above all the index root's lock, which
    would stay held while the child lives, and the version's files, which it must never write."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _die_with(parent: int) -> None:
    """A SIGKILLed consumer takes its reader with it (Linux), so none outlives a killed job."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above ran
        os._exit(1)


def _picklable(exc: BaseException) -> BaseException:
    """The error itself when it survives the trip back; its type and message otherwise."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
